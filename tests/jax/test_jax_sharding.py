"""Heads sharded over devices (``shard_heads``, Linen ``shard_variables``), on 4 CPU devices.

JAX sees 4 CPU devices only with ``--xla_force_host_platform_device_count=4``
set before it is imported, so every multi-device check runs in one
subprocess (this file run as a script), which prints its measurements as
JSON; the tests below assert on them. Each sharded layer's results (forward,
attention weights, gradients of the inputs, weights and gates, cached
decoding) are compared with the float64 reference of :mod:`mha_multi.spec`
within the float32 tolerances of the parity harness, as the unsharded
layer's are. Checks that need no second device run in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

FLOAT32_ATOL, FLOAT32_GRAD_ATOL = 5e-6, 5e-5
NUM_DEVICES = 4
MARK = "RESULTS:"
ROOT = Path(__file__).resolve().parents[2]

#: (name, num_kv_heads, mesh shape, batch axis of the inputs)
CONFIGS = (("mha-1d", None, (4,), None), ("gqa-2d", 2, (2, 2), "data"))
IMPLEMENTATIONS = ("generic", "xla")
#: What each (config, implementation) checks beyond the compiled forward: each
#: compilation costs a second or more, so the plan covers every feature on
#: both meshes and both attention paths without running each one 4 times.
PLAN = {
    "mha-1d/generic": {"eager", "grad", "decode", "dropout"},
    "mha-1d/xla": set(),
    "gqa-2d/generic": {"grad"},
    "gqa-2d/xla": {"grad", "decode"},
}
#: The Linen module runs on the 2-D mesh (inputs split by examples).
LINEN_CONFIG = "gqa-2d"


def worker() -> dict[str, Any]:
    """Every multi-device check; runs where JAX sees 4 CPU devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from mha_multi import spec
    from mha_multi.jax import (
        MultiHeadAttention,
        get_weights,
        linen,
        set_weights,
        shard_cache,
        shard_heads,
    )
    from mha_multi.weights import init_weights

    assert jax.device_count() == NUM_DEVICES, jax.devices()
    results: dict[str, Any] = {"errors": {}, "grad_errors": {}}
    errors, grad_errors = results["errors"], results["grad_errors"]

    def err(a: Any, b: Any) -> float:
        return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))

    def spec_of(x: jax.Array) -> list[Any]:
        return list(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else ["single"]

    def collectives(text: str) -> dict[str, int]:
        ops = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
        lines = text.splitlines()
        return {op: sum(f" {op}(" in ln or f" {op}-start(" in ln for ln in lines) for op in ops}

    rng = np.random.default_rng(0)
    D, B, T, H = 32, 4, 8, 4
    queries, keys, values = (rng.standard_normal((B, T, D)).astype(np.float32) for _ in range(3))
    cotangent = rng.standard_normal((B, T, D)).astype(np.float32)
    lens = np.array([3, 8, 5, 1], np.int32)
    gates = rng.uniform(0.5, 1.5, (B, H)).astype(np.float32)
    prompts = np.array([5, 2, 3, 4], np.int32)
    auto = AxisType.Auto

    for name, num_kv_heads, mesh_shape, batch_axis in CONFIGS:
        axes = ("model",) if len(mesh_shape) == 1 else ("data", "model")
        mesh = jax.make_mesh(mesh_shape, axes, axis_types=(auto,) * len(axes))
        weights = init_weights(D, num_heads=H, num_kv_heads=num_kv_heads, bias=True, seed=1)
        layout = {"num_heads": H, "num_kv_heads": num_kv_heads}
        batch = NamedSharding(mesh, P(batch_axis))
        placed = [jax.device_put(x, batch) for x in (queries, keys, values, lens, gates)]
        # The float64 reference of every call below.
        call = (queries, keys, values, lens)
        expected_output, expected_weights = spec.reference_forward(
            weights, *call, causal=True, head_mask=gates, **layout
        )
        expected_grads = spec.reference_gradients(
            weights, *call, causal=True, head_mask=gates, output_gradient=cotangent, **layout
        )
        heads = spec.Heads(H, num_kv_heads or H, D // H)
        shape = spec.cache_shape(B, 16, heads)
        cache = spec.KVCache(np.zeros(shape), np.zeros(shape), np.zeros(B, np.int32))
        expected_decode = []
        for i, (start, stop) in enumerate([(0, 5), (5, 6), (6, 7), (7, 8)]):
            x = queries[:, start:stop]
            out, _, cache = spec.reference_cached_forward(
                weights, x, x, x, cache, prompts if i == 0 else None, causal=True, **layout
            )
            expected_decode.append(out)
        expected_cache = cache

        for implementation in IMPLEMENTATIONS:
            tag, plan = f"{name}/{implementation}", PLAN[f"{name}/{implementation}"]
            layer = MultiHeadAttention(
                D,
                H,
                bias=True,
                num_kv_heads=num_kv_heads,
                implementation=None if implementation == "generic" else implementation,
            )
            set_weights(layer, weights).eval()
            assert not layer.head_parallel
            shard_heads(layer, mesh)
            results[f"{tag}/head_parallel"] = layer.head_parallel
            if implementation == "generic":
                # The parameters really are split: each device holds its columns/rows.
                for proj in ("W_q", "W_k", "W_o"):
                    value = getattr(layer, proj).kernel[...]
                    results[f"{name}/{proj}.kernel"] = {
                        "spec": spec_of(value),
                        "shards": sorted({s.data.shape for s in value.addressable_shards}),
                        "count": len(value.addressable_shards),
                    }
                results[f"{name}/b_o"] = spec_of(layer.W_o.bias[...])
                pspecs = nnx.get_partition_spec(nnx.state(layer))
                results[f"{name}/partition_spec.W_o"] = list(pspecs["W_o"]["kernel"].get_value())
                results[f"{name}/partition_spec.b_q"] = list(pspecs["W_q"]["bias"].get_value())
                errors[f"{name}/get_weights"] = max(
                    err(a, weights[k]) for k, a in get_weights(layer).items()
                )
                set_weights(layer, weights)  # keeps each parameter where it is
                results[f"{name}/set_weights_spec.W_o"] = spec_of(layer.W_o.kernel[...])

            def forward(layer, q, k, v, lens, gates):
                return layer(
                    q,
                    k,
                    v,
                    lens,
                    causal=True,
                    head_mask=gates,
                    return_attention_weights=implementation == "generic",  # noqa: B023
                )

            # One compilation gives the numbers and the partitioned program.
            graphdef, state = nnx.split(layer)
            compiled = (
                jax.jit(lambda state, *args: forward(nnx.merge(graphdef, state), *args))  # noqa: B023
                .lower(state, *placed)
                .compile()
            )
            results[f"{tag}/collectives"] = collectives(compiled.as_text())
            got = compiled(state, *placed)
            if implementation == "generic":
                errors[f"{tag}/weights"] = err(got[1], expected_weights)
                got = got[0]
            errors[f"{tag}/output"] = err(got, expected_output)
            results[f"{tag}/output_spec"] = spec_of(got)
            if "eager" in plan:
                # Unjitted calls are partitioned op by op.
                errors[f"{tag}/eager"] = err(
                    layer(*placed[:4], causal=True, head_mask=placed[4]), expected_output
                )

            if "dropout" in plan:
                # One key draws the same mask on the sharded layer as on one device.
                pair = [MultiHeadAttention(D, H, dropout=0.5, bias=True) for _ in range(2)]
                for one in pair:
                    set_weights(one, weights)
                shard_heads(pair[1], mesh)
                dropped = nnx.jit(lambda layer, *args: layer(*args, rngs=jax.random.key(7)))
                errors[f"{tag}/dropout"] = err(
                    dropped(pair[1], *placed[:4]), dropped(pair[0], *call)
                )
                results[f"{tag}/dropout_changes"] = err(
                    dropped(pair[0], *call), spec.reference_forward(weights, *call, **layout)[0]
                )

            def loss(layer, q, k, v, gates):
                return jnp.sum(layer(q, k, v, lens, causal=True, head_mask=gates) * cotangent)

            if "grad" in plan:
                grad = nnx.jit(nnx.grad(loss, argnums=(0, 1, 2, 3, 4)))
                got = grad(layer, *placed[:3], placed[4])
                for proj in ("q", "k", "v", "o"):
                    for entry, canonical in (("kernel", f"W_{proj}"), ("bias", f"b_{proj}")):
                        grad_errors[f"{tag}/grad.{canonical}"] = err(
                            got[0][f"W_{proj}"][entry].get_value(), expected_grads[canonical]
                        )
                for i, arg in enumerate(("queries", "keys", "values", "head_mask"), start=1):
                    grad_errors[f"{tag}/grad.{arg}"] = err(got[i], expected_grads[arg])
                results[f"{tag}/grad_spec.W_q"] = spec_of(got[0]["W_q"]["kernel"].get_value())
                results[f"{tag}/grad_spec.W_o"] = spec_of(got[0]["W_o"]["kernel"].get_value())

            if "decode" in plan:
                # A prefill of ragged prompts, then steps of one position.
                step = nnx.jit(
                    lambda layer, x, n, cache: layer(x, x, x, n, causal=True, cache=cache)
                )
                cache = layer.init_cache(B, 16)
                results[f"{tag}/init_cache_spec"] = spec_of(cache.keys)
                if batch_axis is not None:
                    cache = shard_cache(cache, mesh, batch_axis=batch_axis)
                decode_errors = []
                for i, (start, stop) in enumerate([(0, 5), (5, 6), (6, 7), (7, 8)]):
                    x = jax.device_put(queries[:, start:stop], batch)
                    n = jax.device_put(prompts, batch) if i == 0 else None
                    out, cache = step(layer, x, n, cache)
                    decode_errors.append(err(out, expected_decode[i]))
                errors[f"{tag}/decode"] = max(decode_errors)
                errors[f"{tag}/decode_cache"] = max(
                    err(cache.keys, expected_cache.keys), err(cache.values, expected_cache.values)
                )
                results[f"{tag}/decode_lengths"] = np.asarray(cache.lengths).tolist()
                results[f"{tag}/decode_cache_spec"] = spec_of(cache.keys)

        if name == "mha-1d":
            # NNX's optimizer states follow the parameters' sharding metadata.
            optimizer = nnx.Optimizer(layer, optax.adam(1e-3), wrt=nnx.Param)
            results[f"{name}/adam_mu_spec"] = spec_of(
                optimizer.opt_state[0].mu["W_q"]["kernel"].get_value()
            )

        if name != LINEN_CONFIG:
            continue
        # Linen: the same layout through partition specs, under jax.jit.
        module = linen.MultiHeadAttention(
            D, H, bias=True, num_kv_heads=num_kv_heads, head_parallel=True
        )
        variables = linen.shard_variables(
            module, linen.variables_from_weights(weights, module), mesh
        )
        results[f"{name}/linen_spec.W_v.kernel"] = spec_of(variables["params"]["W_v"]["kernel"])
        results[f"{name}/linen_spec.W_o.kernel"] = spec_of(variables["params"]["W_o"]["kernel"])

        def linen_loss(variables, q):
            out = module.apply(variables, q, keys, values, lens, causal=True, head_mask=gates)  # noqa: B023
            return jnp.sum(out * cotangent), out

        linen_forward = jax.jit(
            lambda variables, *args: module.apply(variables, *args, causal=True)  # noqa: B023
        )
        results[f"{name}/linen/collectives"] = collectives(
            linen_forward.lower(variables, *placed[:4]).compile().as_text()
        )
        linen_grad = jax.jit(jax.grad(linen_loss, argnums=(0, 1), has_aux=True))
        (g_vars, g_q), out = linen_grad(variables, placed[0])
        errors[f"{name}/linen/output"] = err(out, expected_output)
        grad_errors[f"{name}/linen/grad.queries"] = err(g_q, expected_grads["queries"])
        for proj in ("W_q", "W_k", "W_v", "W_o"):
            grad_errors[f"{name}/linen/grad.{proj}"] = err(
                g_vars["params"][proj]["kernel"], expected_grads[proj]
            )
        apply = jax.jit(
            lambda v, x, n, cache: module.apply(v, x, x, x, n, causal=True, cache=cache)  # noqa: B023
        )
        cache = shard_cache(module.init_cache(B, 16), mesh, batch_axis=batch_axis)
        x = jax.device_put(queries[:, :5], batch)
        out, cache = apply(variables, x, jax.device_put(prompts, batch), cache)
        step_out, cache = apply(variables, jax.device_put(queries[:, 5:6], batch), None, cache)
        errors[f"{name}/linen/decode"] = max(
            err(out, expected_decode[0]), err(step_out, expected_decode[1])
        )
        results[f"{name}/linen/cache_spec"] = spec_of(cache.keys)

    # Each head's sink logit goes with its head (NNX and Linen).
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(auto, auto))
    weights = init_weights(D, num_heads=H, num_kv_heads=2, bias=True, sinks=True, seed=2)
    weights["sinks"] = np.linspace(-1.0, 2.0, H, dtype=np.float32)
    layout = {"num_heads": H, "num_kv_heads": 2, "sinks": True}
    call = (queries, keys, values, lens)
    expected_output, _ = spec.reference_forward(weights, *call, causal=True, **layout)
    expected_grads = spec.reference_gradients(
        weights, *call, causal=True, output_gradient=cotangent, **layout
    )
    layer = MultiHeadAttention(D, H, bias=True, num_kv_heads=2, sinks=True)
    set_weights(layer, weights).eval()
    shard_heads(layer, mesh)
    results["sinks/spec"] = spec_of(layer.sinks[...])

    def sinks_loss(layer, q):
        out = layer(q, keys, values, lens, causal=True)
        return jnp.sum(out * cotangent), out

    (grads, _), out = nnx.jit(nnx.grad(sinks_loss, argnums=(0, 1), has_aux=True))(layer, queries)
    errors["sinks/output"] = err(out, expected_output)
    grad_errors["sinks/grad.sinks"] = err(grads["sinks"].get_value(), expected_grads["sinks"])
    module = linen.MultiHeadAttention(D, H, bias=True, num_kv_heads=2, sinks=True)
    variables = linen.shard_variables(module, linen.variables_from_weights(weights, module), mesh)
    results["sinks/linen_spec"] = spec_of(variables["params"]["sinks"])
    linen_out = jax.jit(lambda v: module.apply(v, *call, causal=True))(variables)
    errors["sinks/linen/output"] = err(linen_out, expected_output)

    # Shard counts that do not divide the heads.
    three = Mesh(np.array(jax.devices()[:3]), ("model",))
    four = jax.make_mesh((4,), ("model",), axis_types=(auto,))
    bad = {
        "heads_3": lambda: shard_heads(MultiHeadAttention(D, 4), three),
        "kv_heads_4": lambda: shard_heads(MultiHeadAttention(D, 4, num_kv_heads=2), four),
        "linen_heads_3": lambda: linen.shard_variables(
            linen.MultiHeadAttention(D, 4),
            linen.variables_from_weights(init_weights(D), None),
            three,
        ),
    }
    messages = results["messages"] = {}
    for key, bad_call in bad.items():
        try:
            bad_call()
            messages[key] = None
        except ValueError as e:
            messages[key] = str(e)
    return results


def run_worker() -> dict[str, Any]:
    """:func:`worker`'s results, from a process where JAX sees several CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith(MARK)]
    return json.loads(line[len(MARK) :])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # Imported here: this file also runs as the worker's script, without tests/fixtures.
    from computed_once import computed_once

    return computed_once(tmp_path_factory, "jax-sharding", run_worker)


def tags(check: str | None = None) -> list[str]:
    return [tag for tag, plan in PLAN.items() if check is None or check in plan]


@pytest.mark.parametrize("tag", tags())
def test_forward_equals_unsharded(results: dict[str, Any], tag: str) -> None:
    errors = {k: v for k, v in results["errors"].items() if k.startswith(tag + "/")}
    expected = {"output"} | (PLAN[tag] - {"grad", "decode"})
    if "dropout" in PLAN[tag]:
        assert results[f"{tag}/dropout_changes"] > 0.1  # the mask did drop weights
    if tag.endswith("generic"):
        expected.add("weights")
    if "decode" in PLAN[tag]:
        expected |= {"decode", "decode_cache"}
    assert {k.split("/")[-1] for k in errors} == expected
    assert all(v <= FLOAT32_ATOL for v in errors.values()), errors


@pytest.mark.parametrize("tag", tags("grad"))
def test_gradients_equal_unsharded(results: dict[str, Any], tag: str) -> None:
    errors = {k: v for k, v in results["grad_errors"].items() if k.startswith(tag + "/")}
    assert len(errors) == 12  # 8 parameters, 3 inputs, the gates
    assert all(v <= FLOAT32_GRAD_ATOL for v in errors.values()), errors
    # Each device holds its heads' gradients, as it holds their parameters.
    assert results[f"{tag}/grad_spec.W_q"] == [None, "model"]
    assert results[f"{tag}/grad_spec.W_o"][:1] == ["model"]


@pytest.mark.parametrize("tag", tags("decode"))
def test_decode_with_a_sharded_cache(results: dict[str, Any], tag: str) -> None:
    assert results[f"{tag}/init_cache_spec"][:2] == [None, "model"]
    batch = "data" if tag.startswith("gqa-2d") else None
    assert results[f"{tag}/decode_cache_spec"][:2] == [batch, "model"]
    assert results[f"{tag}/decode_lengths"] == [8, 5, 6, 7]


def test_sinks_are_split_with_their_heads(results: dict[str, Any]) -> None:
    assert results["sinks/spec"] == ["model"]
    assert results["sinks/linen_spec"] == ["model"]
    for key in ("sinks/output", "sinks/linen/output"):
        assert results["errors"][key] <= 5e-6, key
    assert results["grad_errors"]["sinks/grad.sinks"] <= 5e-5


def test_linen_equals_unsharded(results: dict[str, Any]) -> None:
    name, errors = LINEN_CONFIG, results["errors"]
    assert errors[f"{name}/linen/output"] <= FLOAT32_ATOL
    assert errors[f"{name}/linen/decode"] <= FLOAT32_ATOL
    grads = {k: v for k, v in results["grad_errors"].items() if k.startswith(f"{name}/linen/")}
    assert len(grads) == 5 and max(grads.values()) <= FLOAT32_GRAD_ATOL, grads
    assert results[f"{name}/linen_spec.W_v.kernel"] == [None, "model"]
    assert results[f"{name}/linen_spec.W_o.kernel"] == ["model", None]
    assert results[f"{name}/linen/cache_spec"][:2] == ["data", "model"]
    counts = results[f"{name}/linen/collectives"]
    assert counts["all-reduce"] == 1 and sum(counts.values()) == 1, counts


@pytest.mark.parametrize(("name", "num_kv_heads", "mesh_shape", "batch_axis"), CONFIGS)
def test_parameters_are_split(
    results: dict[str, Any], name: str, num_kv_heads: int | None, mesh_shape: tuple, batch_axis: Any
) -> None:
    model = mesh_shape[-1]
    kv_width = 32 if num_kv_heads is None else 32 * num_kv_heads // 4
    for proj, shard in (("W_q", [32, 32 // model]), ("W_k", [32, kv_width // model])):
        placed = results[f"{name}/{proj}.kernel"]
        assert placed["spec"] == [None, "model"]
        assert placed["shards"] == [shard]  # every device holds 1/n of the columns
        assert placed["count"] == NUM_DEVICES
    assert results[f"{name}/W_o.kernel"]["spec"] == ["model", None]
    assert results[f"{name}/W_o.kernel"]["shards"] == [[32 // model, 32]]
    assert results[f"{name}/b_o"] == []  # replicated
    # NNX reads the layout back from the parameters' metadata.
    assert results[f"{name}/partition_spec.W_o"] == ["model", None]
    assert results[f"{name}/partition_spec.b_q"] == ["model"]
    assert results["errors"][f"{name}/get_weights"] == 0.0
    assert results[f"{name}/set_weights_spec.W_o"] == ["model", None]
    # The output keeps the inputs' batch layout, whole on every device of the model axis.
    for tag in (f"{name}/generic", f"{name}/xla"):
        assert results[f"{tag}/output_spec"][:1] in ([batch_axis], [])
        assert "model" not in str(results[f"{tag}/output_spec"])


def test_optimizer_states_follow(results: dict[str, Any]) -> None:
    assert results["mha-1d/adam_mu_spec"] == [None, "model"]


@pytest.mark.parametrize("tag", tags())
def test_forward_reduces_once(results: dict[str, Any], tag: str) -> None:
    # Each device attends with its own heads, on either path (the generic one
    # maps the spec's attention over the heads): the one communication is the
    # sum of the partial outputs after W_o.
    assert results[f"{tag}/head_parallel"] is True
    counts = results[f"{tag}/collectives"]
    assert counts["all-reduce"] == 1, counts
    assert sum(counts.values()) == 1, counts


def test_shard_counts_must_divide_heads(results: dict[str, Any]) -> None:
    from mha_multi import spec

    def message(heads: spec.Heads, n: int) -> str:
        with pytest.raises(ValueError) as info:
            spec.shard_heads(heads, n)
        return str(info.value)

    messages = results["messages"]
    assert messages["heads_3"] == message(spec.Heads(4, 4, 8), 3)
    assert messages["linen_heads_3"] == message(spec.Heads(4, 4, 8), 3)
    assert messages["kv_heads_4"] == message(spec.Heads(4, 2, 8), 4)
    assert "num_kv_heads (2)" in messages["kv_heads_4"]


# In-process: one device is enough for the argument checks and the Linen specs.


def test_bad_arguments() -> None:
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from mha_multi.jax import MultiHeadAttention, linen, shard_cache, shard_heads

    devices = np.array(jax.devices()[:1])
    mesh = Mesh(devices, ("model",))
    layer = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"axis='heads' is not an axis of the mesh"):
        shard_heads(layer, mesh, axis="heads")
    explicit = Mesh(devices, ("model",), axis_types=(AxisType.Explicit,))
    with pytest.raises(ValueError, match=r"axis='model' is an Explicit axis"):
        shard_heads(layer, explicit)
    with pytest.raises(TypeError, match="layer must be"):
        shard_heads(linen.MultiHeadAttention(8, 2), mesh)
    with pytest.raises(TypeError, match="mesh must be"):
        shard_heads(layer, "model")
    with pytest.raises(ValueError, match="batch_axis must differ"):
        shard_cache(layer.init_cache(2, 4), mesh, batch_axis="model")
    whole = {"scope": "whole"}
    with pytest.raises(ValueError, match="sharding heads is not possible with qk_norm"):
        shard_heads(MultiHeadAttention(8, 2, qk_norm=whole), mesh)
    module = linen.MultiHeadAttention(8, 2, qk_norm=whole)
    with pytest.raises(ValueError, match="sharding heads is not possible with qk_norm"):
        linen.shard_variables(module, {}, mesh)
    # Queries split on an Explicit batch axis: a cached call names it (the cache's
    # update failed deep inside JAX); one without a cache takes them.
    batch = Mesh(
        devices.reshape(1, 1), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto)
    )
    split = jax.device_put(np.ones((2, 3, 8), np.float32), NamedSharding(batch, P("data")))
    assert layer(split, split, split).shape == (2, 3, 8)
    with pytest.raises(ValueError, match=r"a cached call takes no queries split on an Explicit"):
        layer(split, split, split, cache=layer.init_cache(2, 4))
    with pytest.raises(ValueError, match=r"batch_axis='data' is an Explicit axis .* need Auto"):
        shard_cache(layer.init_cache(2, 4), batch, "model", batch_axis="data")
    # A one-device axis divides every head count: the layer keeps computing the same.
    assert shard_heads(layer, mesh) is layer
    x = np.ones((1, 3, 8), np.float32)
    assert layer(x, x, x).shape == (1, 3, 8)


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
def test_head_parallel_equals_reference(num_kv_heads: int | None) -> None:
    # The head-by-head generic path on one device: weights, 2-D float lengths, gradients.
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mha_multi import spec
    from mha_multi.jax import functional
    from mha_multi.weights import init_weights

    rng = np.random.default_rng(3)
    D, H = 16, 4
    weights = init_weights(D, num_heads=H, num_kv_heads=num_kv_heads, bias=True, seed=2)
    q = rng.standard_normal((2, 3, D)).astype(np.float32)
    kv = rng.standard_normal((2, 5, D)).astype(np.float32)
    lens = np.array([[1.5, 4.0, 0.0], [5.0, 2.0, 3.0]], np.float32)
    cotangent = rng.standard_normal((2, 3, D)).astype(np.float32)
    layout = {"num_heads": H, "num_kv_heads": num_kv_heads}

    def call(w: dict, q: jax.Array) -> tuple[jax.Array, jax.Array]:
        return functional.multi_head_attention(
            w, q, kv, kv, lens, causal=True, head_parallel=True, **layout
        )

    output, attention = jax.jit(call)(weights, q)
    expected_output, expected_weights = spec.reference_forward(
        weights, q, kv, kv, lens, causal=True, **layout
    )
    np.testing.assert_allclose(output, expected_output, atol=FLOAT32_ATOL, rtol=0)
    np.testing.assert_allclose(attention, expected_weights, atol=FLOAT32_ATOL, rtol=0)
    grads = jax.grad(lambda w, q: jnp.sum(call(w, q)[0] * cotangent), argnums=(0, 1))(weights, q)
    expected = spec.reference_gradients(
        weights, q, kv, kv, lens, causal=True, output_gradient=cotangent, **layout
    )
    for name, got in (*grads[0].items(), ("queries", grads[1])):
        np.testing.assert_allclose(got, expected[name], atol=FLOAT32_GRAD_ATOL, rtol=0)


def test_linen_partition_specs() -> None:
    from jax.sharding import PartitionSpec as P

    from mha_multi.jax import linen
    from mha_multi.weights import init_weights

    module = linen.MultiHeadAttention(8, 2, bias=True)
    variables = linen.variables_from_weights(init_weights(8, bias=True), module)
    columns = {"kernel": P(None, "mp"), "bias": P("mp")}
    assert linen.partition_specs(variables, axis="mp") == {
        "params": {
            "W_q": columns,
            "W_k": columns,
            "W_v": columns,
            "W_o": {"kernel": P("mp", None), "bias": P()},
        }
    }
    no_bias = linen.variables_from_weights(init_weights(8), None)["params"]
    assert linen.partition_specs(no_bias)["W_o"] == {"kernel": P("model", None)}
    with pytest.raises(ValueError, match="params/dense is not a projection"):
        linen.partition_specs({"params": {"dense": {"kernel": 0}}})


if __name__ == "__main__":
    print(MARK + json.dumps(worker()))
