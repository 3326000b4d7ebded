"""Heads sharded over two gloo processes (``shard_heads``) equal the unsharded layer.

One run of two spawned processes (spawning is the expensive part) makes
every sharded computation and records its results; the tests compare them
with the same layer unsharded, computed here from the same weights and
inputs, within float32 tolerances: outputs, attention weights (each process
holds its own heads), gradients of the inputs, of ``head_mask`` and of the
weights (gathered), the cache of a decode, and the error messages.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mha_multi import spec
from mha_multi.interop.torch import from_torch_d2l, to_torch_d2l
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights
from mha_multi.weights import init_weights

WORLD_SIZE = 2
#: Unit-scale data: float32 sums in another order differ by a few ulps.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
BATCH, LENGTH = 3, 5
#: The layer and call of each case: cross-attention with input sizes of their
#: own, grouped self-attention (the stacked-projection path unsharded), lengths
#: of both shapes, causal masks and both shapes of head masks.
CASES: dict[str, dict[str, Any]] = {
    "cross": {
        "layer": {"num_hiddens": 16, "num_heads": 4, "bias": True},
        "sizes": {"query_size": 5, "key_size": 6, "value_size": 7},
        "call": {"valid_lens": "1d"},
    },
    "grouped_causal": {
        "layer": {"num_hiddens": 16, "num_heads": 4, "num_kv_heads": 2},
        "sizes": {"query_size": 16, "key_size": 16, "value_size": 16},
        "call": {"valid_lens": "2d", "causal": True},
    },
    "grouped_head_mask": {
        "layer": {"num_hiddens": 16, "num_heads": 4, "num_kv_heads": 2, "bias": True},
        "sizes": {"query_size": 16, "key_size": 16, "value_size": 16},
        "call": {"valid_lens": "1d", "causal": True, "head_mask": "2d"},
    },
    "head_mask_vector": {
        "layer": {"num_hiddens": 24, "num_heads": 4, "head_dim": 5, "bias": True},
        "sizes": {"query_size": 6, "key_size": 7, "value_size": 7},
        "call": {"head_mask": "1d"},
    },
    # Per-head query/key norms: every process holds their weights whole, and
    # their gradient sums every process's heads.
    "qk_norm": {
        "layer": {"num_hiddens": 16, "num_heads": 4, "num_kv_heads": 2, "qk_norm": {}},
        "sizes": {"query_size": 16, "key_size": 16, "value_size": 16},
        "call": {"valid_lens": "1d", "causal": True},
    },
    # Each head's sink logit goes with its head; a fully hidden row.
    "sinks": {
        "layer": {"num_hiddens": 16, "num_heads": 4, "num_kv_heads": 2, "sinks": True},
        "sizes": {"query_size": 16, "key_size": 16, "value_size": 16},
        "call": {"valid_lens": "1d", "causal": True},
    },
}
#: The decode: grouped heads, prompts of 4, 1 and 3 positions, then two steps.
DECODE = {"layer": CASES["grouped_head_mask"]["layer"], "prompts": [4, 1, 3], "steps": 2}


def _weights(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    config = CASES[name]
    layer = {k: v for k, v in config["layer"].items() if k != "qk_norm"}
    weights = init_weights(**layer, **config["sizes"], seed=seed)
    if "qk_norm" in config["layer"]:  # (head_dim,) weights, away from their identity
        rng = np.random.default_rng(seed)
        head_dim = weights["W_q"].shape[1] // layer["num_heads"]
        for norm in spec.QK_NORM_NAMES:
            weights[norm] = (1 + 0.5 * rng.standard_normal(head_dim)).astype(np.float32)
    if "sinks" in weights:  # logits that differ by head (they start at zero)
        weights["sinks"] = np.linspace(-1.0, 2.0, len(weights["sinks"]), dtype=np.float32)
    return weights


def _layer(name: str, weights: dict[str, np.ndarray]) -> MultiHeadAttention:
    config = CASES[name]
    return set_weights(MultiHeadAttention(**config["layer"], **config["sizes"]), weights)


def _inputs(name: str) -> dict[str, torch.Tensor | None]:
    """Seeded inputs of a case; self-attention passes one tensor three times."""
    config, call = CASES[name], CASES[name]["call"]
    generator = torch.Generator().manual_seed(sum(map(ord, name)))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    sizes = config["sizes"]
    queries = randn(BATCH, LENGTH, sizes["query_size"])
    if sizes["key_size"] == sizes["query_size"] == sizes["value_size"]:
        keys = values = None  # self-attention
    else:
        keys = randn(BATCH, LENGTH + 1, sizes["key_size"])
        values = randn(BATCH, LENGTH + 1, sizes["value_size"])
    lens = {
        None: None,
        "1d": torch.tensor([LENGTH, 2, 0]),  # 0: a fully hidden row
        "2d": torch.randint(1, LENGTH + 1, (BATCH, LENGTH), generator=generator),
    }[call.get("valid_lens")]
    num_heads = config["layer"]["num_heads"]
    head_mask = {
        None: None,
        "1d": torch.rand(num_heads, generator=generator) + 0.5,
        "2d": torch.rand(BATCH, num_heads, generator=generator) + 0.5,
    }[call.get("head_mask")]
    tensors = {"queries": queries, "keys": keys, "values": values}
    return tensors | {"valid_lens": lens, "head_mask": head_mask}


def _importance_inputs(name: str) -> tuple[list[tuple[Any, ...]], Any]:
    """``head_importance``'s batches and loss for case ``name``: two batches, the
    second the first's examples in reverse order, and a loss weighing every
    output differently."""
    inputs = _inputs(name)
    first = (inputs["queries"], inputs["keys"], inputs["values"], inputs["valid_lens"])
    second = tuple(x.flip(0) for x in first)
    weights = torch.linspace(-1.0, 1.0, BATCH * LENGTH * CASES[name]["layer"]["num_hiddens"])

    def loss(output: torch.Tensor) -> torch.Tensor:
        return (output * weights.reshape(output.shape)).sum()

    return [first, second], loss


def _forward_backward(
    layer: MultiHeadAttention, name: str, *, return_attention_weights: bool
) -> dict[str, np.ndarray]:
    """One call of ``layer`` on case ``name`` and its gradients, as numpy arrays.

    The weights' gradients are gathered whole (``full_tensor``) where the
    layer is sharded: every process of a sharded layer must call this.
    """
    inputs = _inputs(name)
    queries = inputs["queries"].clone().requires_grad_(True)
    if inputs["keys"] is None:
        keys = values = queries
    else:
        keys, values = (inputs[n].clone().requires_grad_(True) for n in ("keys", "values"))
    head_mask = inputs["head_mask"]
    if head_mask is not None:
        head_mask = head_mask.clone().requires_grad_(True)
    causal = CASES[name]["call"].get("causal", False)
    layer.zero_grad(set_to_none=True)
    result = layer(
        queries,
        keys,
        values,
        inputs["valid_lens"],
        causal=causal,
        head_mask=head_mask,
        return_attention_weights=return_attention_weights,
    )
    output, attention = result if return_attention_weights else (result, None)
    cotangent = torch.randn(output.shape, generator=torch.Generator().manual_seed(7))
    output.backward(cotangent)
    arrays = {"output": output, "grad_queries": queries.grad}
    if keys is not queries:
        arrays |= {"grad_keys": keys.grad, "grad_values": values.grad}
    if head_mask is not None:
        arrays["grad_head_mask"] = head_mask.grad
    if attention is not None:
        arrays["attention"] = attention
    for parameter_name, parameter in layer.named_parameters():
        grad = parameter.grad
        arrays[f"grad_{parameter_name}"] = (
            grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        )
    return {key: value.detach().numpy() for key, value in arrays.items()}


def _decode(layer: MultiHeadAttention) -> dict[str, np.ndarray]:
    """A ragged prefill then single-position steps, with head masks; outputs and caches."""
    generator = torch.Generator().manual_seed(3)
    prompts, steps = DECODE["prompts"], DECODE["steps"]
    size = CASES["grouped_head_mask"]["sizes"]["query_size"]
    num_heads = DECODE["layer"]["num_heads"]
    tokens = torch.randn(len(prompts), max(prompts) + steps, size, generator=generator)
    head_mask = torch.rand(num_heads, generator=generator) + 0.5
    arrays = {}
    with torch.no_grad():
        cache = layer.init_cache(len(prompts), max(prompts) + steps + 1)
        prompt = tokens[:, : max(prompts)]
        lens = torch.tensor(prompts)
        arrays["prefill"], cache = layer(
            prompt, prompt, prompt, lens, causal=True, cache=cache, head_mask=head_mask
        )
        for step in range(steps):
            x = tokens[torch.arange(len(prompts)), lens + step].unsqueeze(1)
            out, arrays[f"weights_{step}"], cache = layer(
                x, x, x, causal=True, cache=cache, return_attention_weights=True
            )
            arrays[f"step_{step}"] = out
    arrays |= {"cache_keys": cache.keys, "cache_values": cache.values, "lengths": cache.lengths}
    return {key: value.numpy() for key, value in arrays.items()}


def _error(call: Any) -> str:
    """The message of the exception ``call()`` raises, prefixed by its type."""
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    """Process ``rank``: every sharded computation, saved to ``out_dir/rank<rank>.npz``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from mha_multi.torch import head_importance, shard_heads

    torch.set_num_threads(1)  # two processes share the machine's cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        arrays: dict[str, Any] = {}
        for name in CASES:
            layer = shard_heads(_layer(name, _weights(name)), mesh)
            for flag in (False, True):
                result = _forward_backward(layer, name, return_attention_weights=flag)
                arrays |= {f"{name}/{flag}/{key}": value for key, value in result.items()}
            shapes = {n: getattr(layer, n).weight.to_local().shape for n in ("W_q", "W_k", "W_o")}
            arrays |= {f"{name}/local_shape/{n}": np.array(s) for n, s in shapes.items()}
            arrays[f"{name}/local_heads"] = np.array([layer.num_heads, layer.num_kv_heads])
            arrays |= {f"{name}/get_weights/{k}": v for k, v in get_weights(layer).items()}
        # set_weights on a sharded layer takes the whole layer's weights.
        layer = shard_heads(_layer("cross", _weights("cross")), mesh)
        set_weights(layer, _weights("cross", seed=1))
        arrays |= {f"set_weights/get_weights/{k}": v for k, v in get_weights(layer).items()}
        result = _forward_backward(layer, "cross", return_attention_weights=False)
        arrays |= {f"set_weights/{key}": value for key, value in result.items()}
        # Process 0's weights are the ones kept, the norms' too: each process starts from
        # weights of its own, then loads weights of its own.
        layer = shard_heads(_layer("qk_norm", _weights("qk_norm", seed=10 + rank)), mesh)
        arrays |= {f"first/shard/{k}": v for k, v in get_weights(layer).items()}
        set_weights(layer, _weights("qk_norm", seed=20 + rank))
        arrays |= {f"first/set/{k}": v for k, v in get_weights(layer).items()}
        result = _forward_backward(layer, "qk_norm", return_attention_weights=False)
        arrays |= {f"first/{key}": value for key, value in result.items()}
        decoder = shard_heads(_layer("grouped_head_mask", _weights("grouped_head_mask")), mesh)
        arrays |= {f"decode/{key}": value for key, value in _decode(decoder).items()}

        def sharded(**layer_config: Any) -> Any:
            sizes = CASES["cross"]["sizes"]
            return lambda: shard_heads(MultiHeadAttention(**layer_config, **sizes), mesh)

        queries = torch.zeros(1, 2, CASES["cross"]["sizes"]["query_size"])
        keys = torch.zeros(1, 2, CASES["cross"]["sizes"]["key_size"])
        values = torch.zeros(1, 2, CASES["cross"]["sizes"]["value_size"])
        layer = shard_heads(_layer("cross", _weights("cross")), mesh)
        errors = {
            "num_heads": sharded(num_hiddens=15, num_heads=3),
            "num_kv_heads": sharded(num_hiddens=16, num_heads=4, num_kv_heads=1),
            "mesh_2d": lambda: shard_heads(
                _layer("cross", _weights("cross")), init_device_mesh("cpu", (1, world_size))
            ),
            "lazy": lambda: shard_heads(MultiHeadAttention(16, 4), mesh),
            "whole_qk_norm": sharded(num_hiddens=16, num_heads=4, qk_norm={"scope": "whole"}),
            "twice": lambda: shard_heads(layer, mesh),
            "local_head_mask": lambda: layer(queries, keys, values, head_mask=torch.ones(2)),
            "bfloat16_cpu": lambda: layer.to(torch.bfloat16)(
                *(x.bfloat16() for x in (queries, keys, values))
            ),
            "alibi": sharded(num_hiddens=16, num_heads=4, alibi=True),
            "from_d2l": lambda: from_torch_d2l(layer),
            "to_d2l": lambda: to_torch_d2l(_weights("cross"), layer),
        }
        autocast_layer = shard_heads(_layer("cross", _weights("cross")), mesh)

        def autocast_call() -> Any:
            with torch.autocast("cpu", torch.bfloat16):
                return autocast_layer(queries, keys, values)

        errors["autocast"] = autocast_call
        arrays |= {f"error/{key}": np.array(_error(call)) for key, call in errors.items()}
        importance_layer = shard_heads(_layer("cross", _weights("cross")), mesh)
        arrays["head_importance"] = head_importance(importance_layer, *_importance_inputs("cross"))
        np.savez(Path(out_dir) / f"rank{rank}.npz", **arrays)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, np.ndarray]]:
    """The two processes' results: one spawn for the whole file."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        # A file store: no port to pick on a machine others share.
        init_method = (Path(out_dir) / "store").as_uri()
        context = mp.start_processes(
            _worker,
            args=(WORLD_SIZE, init_method, out_dir),
            nprocs=WORLD_SIZE,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 300
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.terminate()
                pytest.fail("the sharded processes did not finish in 300 s")
        results = []
        for rank in range(WORLD_SIZE):
            with np.load(Path(out_dir) / f"rank{rank}.npz", allow_pickle=False) as saved:
                results.append(dict(saved))
        return results


def _sharded(ranks: list[dict[str, np.ndarray]], prefix: str) -> list[dict[str, np.ndarray]]:
    return [{k[len(prefix) :]: v for k, v in r.items() if k.startswith(prefix)} for r in ranks]


def _heads_of(rank: int, num_heads: int) -> slice:
    """The heads process ``rank`` holds: a contiguous block (``spec.shard_heads``)."""
    local = num_heads // WORLD_SIZE
    return slice(rank * local, (rank + 1) * local)


@pytest.mark.parametrize("return_attention_weights", [False, True], ids=["fused", "generic"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_equal_unsharded(
    ranks: list[dict[str, np.ndarray]], name: str, return_attention_weights: bool
) -> None:
    expected = _forward_backward(
        _layer(name, _weights(name)), name, return_attention_weights=return_attention_weights
    )
    num_heads = CASES[name]["layer"]["num_heads"]
    for rank, got in enumerate(_sharded(ranks, f"{name}/{return_attention_weights}/")):
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            if key == "attention":  # each process returns its own heads' weights
                value = value[:, _heads_of(rank, num_heads)]
            np.testing.assert_allclose(got[key], value, **TOLERANCE, err_msg=f"{key}, rank {rank}")


@pytest.mark.parametrize("name", list(CASES))
def test_each_process_holds_its_share(ranks: list[dict[str, np.ndarray]], name: str) -> None:
    config = CASES[name]
    heads = spec.check_heads(
        config["layer"]["num_hiddens"],
        config["layer"]["num_heads"],
        num_kv_heads=config["layer"].get("num_kv_heads"),
        head_dim=config["layer"].get("head_dim"),
    )
    q_features, kv_features = heads.query_features, heads.kv_features
    sizes, num_hiddens = config["sizes"], config["layer"]["num_hiddens"]
    # nn.Linear stores (out_features, in_features): W_q/W_k by output rows, W_o by input columns.
    expected = {
        "W_q": (q_features // WORLD_SIZE, sizes["query_size"]),
        "W_k": (kv_features // WORLD_SIZE, sizes["key_size"]),
        "W_o": (num_hiddens, q_features // WORLD_SIZE),
    }
    for got in ranks:
        for linear, shape in expected.items():
            assert tuple(got[f"{name}/local_shape/{linear}"]) == shape, linear
        local = [heads.num_heads // WORLD_SIZE, heads.num_kv_heads // WORLD_SIZE]
        assert got[f"{name}/local_heads"].tolist() == local


@pytest.mark.parametrize("name", list(CASES))
def test_get_weights_gathers_the_whole_layer(ranks: list[dict[str, np.ndarray]], name: str) -> None:
    weights = _weights(name)
    for got in _sharded(ranks, f"{name}/get_weights/"):
        assert sorted(got) == sorted(weights)
        for key, value in weights.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_set_weights_loads_the_whole_layer(ranks: list[dict[str, np.ndarray]]) -> None:
    weights = _weights("cross", seed=1)
    expected = _forward_backward(_layer("cross", weights), "cross", return_attention_weights=False)
    for got in _sharded(ranks, "set_weights/"):
        for key, value in weights.items():
            np.testing.assert_array_equal(got[f"get_weights/{key}"], value, err_msg=key)
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, **TOLERANCE, err_msg=key)


def test_process_0s_weights_are_kept_norms_included(ranks: list[dict[str, np.ndarray]]) -> None:
    """Each process starts from, then loads, weights of its own: process 0's are every
    process's, the per-head norms' (held whole by each) included; the calls give that
    layer's numbers (each process normalised its heads with its own norms before)."""
    expected = _forward_backward(
        _layer("qk_norm", _weights("qk_norm", seed=20)), "qk_norm", return_attention_weights=False
    )
    for got in _sharded(ranks, "first/"):
        for stage, seed in (("shard", 10), ("set", 20)):
            for key, value in _weights("qk_norm", seed=seed).items():
                np.testing.assert_array_equal(got[f"{stage}/{key}"], value, err_msg=key)
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, **TOLERANCE, err_msg=key)


def test_cached_decode_equals_unsharded(ranks: list[dict[str, np.ndarray]]) -> None:
    expected = _decode(_layer("grouped_head_mask", _weights("grouped_head_mask")))
    layer_config = DECODE["layer"]
    for rank, got in enumerate(_sharded(ranks, "decode/")):
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            if key.startswith("cache_"):  # each process caches its own key/value heads
                value = value[:, _heads_of(rank, layer_config["num_kv_heads"])]
            elif key.startswith("weights_"):
                value = value[:, _heads_of(rank, layer_config["num_heads"])]
            np.testing.assert_allclose(got[key], value, **TOLERANCE, err_msg=f"{key}, rank {rank}")


def test_head_importance_of_a_sharded_layer_is_the_whole_layers(
    ranks: list[dict[str, np.ndarray]],
) -> None:
    from mha_multi.torch import head_importance

    expected = head_importance(_layer("cross", _weights("cross")), *_importance_inputs("cross"))
    assert expected.shape == (CASES["cross"]["layer"]["num_heads"],)
    for got in ranks:
        np.testing.assert_allclose(got["head_importance"], expected, **TOLERANCE)


def test_bad_shard_counts_raise_the_spec_error(ranks: list[dict[str, np.ndarray]]) -> None:
    for heads, key in ((spec.Heads(3, 3, 5), "num_heads"), (spec.Heads(4, 1, 4), "num_kv_heads")):
        with pytest.raises(ValueError) as raised:
            spec.shard_heads(heads, WORLD_SIZE)
        for got in ranks:
            assert str(got[f"error/{key}"]) == f"ValueError: {raised.value}"


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("mesh_2d", "ValueError: device_mesh must be 1-D"),
        ("lazy", "ValueError: query_size, key_size, value_size not known yet"),
        ("whole_qk_norm", "ValueError: sharding heads is not possible with qk_norm"),
        ("twice", "ValueError: the layer's heads are already sharded 2 ways"),
        ("local_head_mask", "ValueError: head_mask must have shape (num_heads,) = (4,)"),
        ("bfloat16_cpu", "TypeError: a head-sharded layer computes 16-bit products only"),
        ("alibi", "ValueError: sharding heads is not possible with alibi"),
        ("from_d2l", "ValueError: the module's heads are sharded"),
        ("to_d2l", "ValueError: the module's heads are sharded"),
        (
            "autocast",
            "TypeError: a head-sharded layer computes 16-bit products only where they "
            "accumulate in float32 (CUDA); got torch.bfloat16 products under torch.autocast "
            "of torch.float32 queries",
        ),
    ],
)
def test_errors(ranks: list[dict[str, np.ndarray]], key: str, message: str) -> None:
    for got in ranks:
        assert str(got[f"error/{key}"]).startswith(message), str(got[f"error/{key}"])
