"""PyTorch: a layer's heads sharded over two processes give the unsharded layer's output.

Real runs start one process per device with ``torchrun``, which sets the
rank, world size and rendezvous address of each process:

    torchrun --nproc-per-node 2 train.py

and ``train.py`` shards its layer once the process group is up:

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")  # "nccl" on GPUs (and the layer on its GPU)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layer = shard_heads(layer, mesh)

This script starts its two CPU processes itself, so that it runs as it is.
"""

import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from mha_multi.spec import reference_forward
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights, shard_heads
from mha_multi.weights import init_weights

NUM_HIDDENS, NUM_HEADS, NUM_KV_HEADS = 32, 4, 2  # grouped-query attention


def run(rank: int, world_size: int, store: str) -> None:
    """One process: the same layer and inputs everywhere, then its share of the heads."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
    try:
        weights = init_weights(NUM_HIDDENS, seed=0, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(2, 6, NUM_HIDDENS, generator=generator)
        valid_lens = torch.tensor([6, 3])

        # [shard]
        mesh = init_device_mesh("cpu", (world_size,))
        layer = MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, num_kv_heads=NUM_KV_HEADS)
        layer = set_weights(layer, weights)  # input sizes must be known before sharding
        layer = shard_heads(layer, mesh)  # W_q, W_k, W_v by columns, W_o by rows
        with torch.no_grad():
            out = layer(x, x, x, valid_lens, causal=True)  # (2, 6, 32), whole on every process
        # [/shard]

        # Each process holds W_q's columns of its own heads, and computes only those heads.
        assert layer.W_q.weight.to_local().shape == (NUM_HIDDENS // world_size, NUM_HIDDENS)
        assert (layer.num_heads, layer.num_kv_heads) == (NUM_HEADS // 2, NUM_KV_HEADS // 2)
        # get_weights gathers the whole layer (every process must call it).
        assert all(np.array_equal(get_weights(layer)[k], w) for k, w in weights.items())

        unsharded = MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, num_kv_heads=NUM_KV_HEADS)
        unsharded = set_weights(unsharded, weights)
        with torch.no_grad():
            expected = unsharded(x, x, x, valid_lens, causal=True)
        np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
        x64 = x.numpy()
        reference, _ = reference_forward(
            weights,
            x64,
            x64,
            x64,
            valid_lens.numpy(),
            num_heads=NUM_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            causal=True,
        )
        np.testing.assert_allclose(out.numpy(), reference, rtol=0, atol=5e-6)
        if rank == 0:
            print(f"rank {rank}: {layer.num_heads} of {NUM_HEADS} heads, output {tuple(out.shape)}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        # A file store for the rendezvous: no port to pick.
        store = (Path(directory) / "store").as_uri()
        mp.spawn(run, args=(2, store), nprocs=2)  # raises if a process failed
