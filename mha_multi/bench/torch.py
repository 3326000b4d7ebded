"""PyTorch benchmark: ours (fused and generic) vs ``torch.nn.MultiheadAttention``.

``torch.nn.MultiheadAttention`` has no grouped key/value heads; grouped rows
are timed against PyTorch's own grouped-query route instead,
:class:`SDPALayer`, which is also the long training pass's anchor
(:mod:`mha_multi.bench.long`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mha_multi import spec
from mha_multi.bench.common import Shape, median_seconds, score_bytes
from mha_multi.bench.framework import Framework, Route
from mha_multi.bench.generate import GenerationShape, Generator
from mha_multi.bench.torch_decoders import (
    compiled,
    forget_compiled,
    hand_written_call,
    hand_written_decoder,
)
from mha_multi.interop.torch import key_padding_mask, to_torch_d2l
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import set_weights
from mha_multi.weights import init_weights


class SDPALayer(nn.Module):
    """Self-attention as PyTorch offers it: ``nn.Linear`` projections named as d2l's,
    and ``scaled_dot_product_attention`` given the key padding as a boolean mask (or
    none) and its own causal flag; ``enable_gqa=True`` for grouped heads."""

    def __init__(self, num_hiddens: int, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        kv_features = num_hiddens // num_heads * num_kv_heads
        self.W_q = nn.Linear(num_hiddens, num_hiddens, bias=False)
        self.W_k = nn.Linear(num_hiddens, kv_features, bias=False)
        self.W_v = nn.Linear(num_hiddens, kv_features, bias=False)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=False)

    def forward(
        self, x: torch.Tensor, padding: torch.Tensor | None = None, *, causal: bool = False
    ) -> torch.Tensor:
        q = self.W_q(x).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        k, v = (
            linear(x).unflatten(-1, (self.num_kv_heads, -1)).transpose(1, 2)
            for linear in (self.W_k, self.W_v)
        )
        visible = None if padding is None else ~padding[:, None, None, :]
        context = nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=visible,
            is_causal=causal,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return self.W_o(context.transpose(1, 2).flatten(2))


class Torch(Framework):
    """Forward passes under ``torch.inference_mode``; the native layer gets the
    key padding as ``key_padding_mask`` (``True`` = hidden)."""

    name = "torch"
    package = "mha_multi.torch"
    backend = backend

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)

    def append(self, sequence: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return torch.cat([sequence, token], dim=1)

    hand_written = staticmethod(hand_written_decoder)
    hand_written_call = staticmethod(hand_written_call)
    # Eager, and ours and the hand-written step under torch.compile (one graph
    # each, static shapes; CUDA graphs on a GPU).
    generation_executions = (None, "compiled")

    def describe(self, device: str, execution: str | None) -> str:
        described = super().describe(device, execution)
        return described if execution is None else f"{described}; torch.compile(fullgraph=True)"

    def eager_layer_call(self, layer: Any, *, training: bool = False) -> Callable[..., Any]:
        """Under ``torch.inference_mode`` in evaluation mode, as a user decodes;
        ``training``: ``train()`` mode, recording gradients."""
        layer.train(training)
        call = super().eager_layer_call(layer)
        if training:
            return call

        def inferring(x: torch.Tensor, cache: Any = None) -> Any:
            with torch.inference_mode():
                return call(x, cache)

        return inferring

    def host_routes(self, device: str) -> dict[str, Route]:
        """One thread; on the CPU's route and, told that every tensor is on a GPU
        (``as_if_on_a_gpu``), on the route a GPU's call takes."""
        return {"cpu": _one_thread, "gpu": _gpu_route}

    def generators(
        self, shape: GenerationShape, device: str, dtype: str, execution: str | None = None
    ) -> dict[str, Callable[[], Generator]]:
        if execution == "compiled":
            forget_compiled()  # each configuration's graphs afresh
        return super().generators(shape, device, dtype, execution)

    def cached_call(self, layer: Any, execution: str | None = None) -> Callable[..., Any]:
        """The layer in evaluation mode called under ``torch.inference_mode``, as a user
        decodes and as the hand-written decoder runs (the cache ``init_cache`` makes
        keeps its versions there; docs: "Generating with a cache"); ``"compiled"``:
        the call under :func:`~mha_multi.bench.torch_decoders.compiled`, the cache
        written in place (docs: "Errors, and what compiled code does")."""
        layer.eval()

        def call(x: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
            return layer(x, x, x, causal=True, cache=cache)

        if execution == "compiled":
            device = "gpu" if next(layer.parameters()).is_cuda else "cpu"
            call = compiled(call, device)

        def cached(x: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
            with torch.inference_mode():
                return call(x, cache)

        return cached

    def convert(
        self, x: np.ndarray, lens: np.ndarray, visible: np.ndarray, device: str, dtype: str
    ) -> tuple[torch.Tensor, ...]:
        padding = key_padding_mask(lens, x.shape[1]).to(backend.device(device))
        return self.array(x, device, dtype), backend.lens_to_native(lens, device), padding

    def build(self, shape: Shape, device: str, dtype: str) -> dict[str, Any]:
        d, h, kv_heads = shape.num_hiddens, shape.num_heads, shape.kv_heads
        # Both layers hold the same weights.
        weights = init_weights(d, num_heads=h, num_kv_heads=kv_heads)
        sizes = {"query_size": d, "key_size": d, "value_size": d}
        ours = backend.make_layer(d, h, num_kv_heads=kv_heads, device=device, dtype=dtype, **sizes)
        ours = set_weights(ours, weights).eval()
        if kv_heads == h:
            native = backend.native_layer(weights, h, device=device, dtype=dtype)

            def native_call(x: torch.Tensor, lens: Any, padding: torch.Tensor) -> torch.Tensor:
                return native(x, x, x, key_padding_mask=padding, need_weights=False)[0]

        else:
            native = to_torch_d2l(weights, SDPALayer(d, h, kv_heads))
            native = native.to(backend.device(device), backend.DTYPES[dtype]).eval()

            def native_call(x: torch.Tensor, lens: Any, padding: torch.Tensor) -> torch.Tensor:
                return native(x, padding)

        return {
            "ours": (ours, lambda x, lens, padding: ours(x, x, x, lens)),
            "ours (generic)": (
                ours,
                lambda x, lens, padding: ours(x, x, x, lens, return_attention_weights=True)[0],
            ),
            "native": (native, native_call),
        }

    def long_pair(self, shape: Shape, device: str, dtype: str) -> dict[str, Any]:
        """Ours and :class:`SDPALayer`, holding the same weights, in training mode (no
        dropout), each calling causal self-attention."""
        d, h, kv_heads = shape.num_hiddens, shape.num_heads, shape.kv_heads
        weights = init_weights(d, num_heads=h, num_kv_heads=kv_heads)
        ours = backend.make_layer(d, h, num_kv_heads=kv_heads, device=device, dtype=dtype)
        ours = set_weights(ours, weights).train()
        sdpa = to_torch_d2l(weights, SDPALayer(d, h, kv_heads))
        sdpa = sdpa.to(backend.device(device), backend.DTYPES[dtype]).train()
        return {
            "ours": (ours, lambda x: ours(x, x, x, causal=True)),
            "SDPA": (sdpa, lambda x: sdpa(x, causal=True)),
        }

    def step(self, impl: Any, args: Any, mode: str, execution: str | None) -> Callable[[], Any]:
        module, call = impl
        x, *rest = args
        if mode == "forward":

            def forward() -> torch.Tensor:
                with torch.inference_mode():
                    return call(x, *rest)

            return forward

        def forward_backward() -> torch.Tensor | None:
            inputs = x.detach().requires_grad_(True)
            call(inputs, *rest).float().sum().backward()
            module.zero_grad(set_to_none=True)
            return inputs.grad

        return forward_backward

    def scratch_bytes(
        self, implementation: str, shape: Shape, dtype: str, device: str, *, training: bool
    ) -> int:
        # Only the generic path materialises (B*H, N, N) arrays: scores,
        # masked scores and weights.
        return score_bytes(shape, 3, dtype) if implementation == "ours (generic)" else 0

    shard_counts = (1, 2)

    def sharded_seconds(self, shape: Shape, num_shards: int) -> float:
        return sharded_seconds(shape, num_shards)

    def peak_mib(self, device: str, run: Callable[[], None]) -> float:
        if device != "gpu":
            return super().peak_mib(device, run)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        return (torch.cuda.max_memory_allocated() - before) / 2**20


FRAMEWORK = Torch()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One thread for PyTorch's kernels, while active (a tiny call's are serial)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _gpu_route() -> Iterator[None]:
    """One thread, and a call on the CPU taking the route a GPU's takes."""
    with _one_thread(), backend.as_if_on_a_gpu():
        yield


def sharded_seconds(shape: Shape, num_shards: int, *, repeats: int = 5) -> float:
    """Median seconds of one forward with the heads sharded over ``num_shards`` processes.

    Self-attention of ``shape`` (inputs ``(batch, length, num_hiddens)``, no
    lengths) by a float32 layer on the CPU, its heads split by
    :func:`mha_multi.torch.shard_heads` over ``num_shards`` fresh gloo
    processes (docs: "Sharding heads"); ``num_shards == 1`` times the
    unsharded layer in one fresh process. The processes share the machine's
    cores, ``cores // num_shards`` threads each, so the figures compare the
    same hardware split differently. Each process times ``repeats`` calls
    after two warm-up calls (the all-reduce after ``W_o`` keeps them in
    step); the slowest process's median is returned.

    Raises:
        ValueError: ``num_shards`` does not divide the shape's head counts
            (:func:`mha_multi.spec.shard_heads`).
        torch.multiprocessing.ProcessRaisedException: a process failed.
    """
    heads = spec.check_heads(shape.num_hiddens, shape.num_heads, num_kv_heads=shape.kv_heads)
    spec.shard_heads(heads, num_shards)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as directory:
        store = (Path(directory) / "store").as_uri()
        fields = dataclasses.astuple(shape)
        mp.spawn(
            _time_shard, args=(num_shards, fields, repeats, store, directory), nprocs=num_shards
        )
        return max(
            float((Path(directory) / f"{rank}.txt").read_text()) for rank in range(num_shards)
        )


def _time_shard(
    rank: int, num_shards: int, fields: tuple, repeats: int, store: str, directory: str
) -> None:
    """One process of :func:`sharded_seconds`: its median, written to ``directory/<rank>.txt``."""
    import torch.distributed as dist

    shape = Shape(*fields)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // num_shards))
    d = shape.num_hiddens
    sizes = dict.fromkeys(("query_size", "key_size", "value_size"), d)
    weights = init_weights(d, num_heads=shape.num_heads, num_kv_heads=shape.kv_heads)
    layer = backend.make_layer(d, shape.num_heads, num_kv_heads=shape.kv_heads, **sizes)
    layer = set_weights(layer, weights).eval()
    x = torch.randn(shape.batch, shape.length, d, generator=torch.Generator().manual_seed(0))
    if num_shards > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from mha_multi.torch import shard_heads

        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=num_shards)
        layer = shard_heads(layer, init_device_mesh("cpu", (num_shards,)))

    def forward() -> torch.Tensor:
        with torch.no_grad():
            output = layer(x, x, x)
        # A sharded layer may return the all-reduce still under way (an
        # AsyncCollectiveTensor, waited for at its first use): the timing waits.
        return output.wait() if hasattr(output, "wait") else output

    try:
        seconds = median_seconds(forward, repeats=repeats)
    finally:
        if num_shards > 1:
            dist.destroy_process_group()
    (Path(directory) / f"{rank}.txt").write_text(repr(seconds))
