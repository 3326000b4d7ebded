"""Heads sharded with Keras' distribution API (docs: "Sharding heads").

On Keras' JAX backend, :func:`mha_multi.keras.layout_map` under
``keras.distribution.ModelParallel`` must split the variables by heads and
give the unsharded layer's numbers (and the float64 reference's, within the
float32 tolerances), forward and gradients, with lengths, the causal rule,
grouped heads, head gates and a cache, and through a step of ``model.fit``; a
shard count that would split a head is a ``ValueError``. Several devices need
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before JAX starts, so
those checks run in one fresh process (this file run as a script) that
prints their results as JSON, asserted here.

On the TensorFlow and PyTorch backends Keras lays no variable out by a
distribution; ``layout_map`` says so (``NotImplementedError`` naming the
backend) and the layer, made under a distribution all the same, is whole and
unchecked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from mha_multi import spec  # noqa: E402
from mha_multi.keras import MultiHeadAttention, get_weights, layout_map, set_weights  # noqa: E402
from mha_multi.parity.compare import tolerance  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402
from mha_multi.weights import init_weights  # noqa: E402

ATOL = tolerance("float32", "output")
GRAD_ATOL = tolerance("float32", "grad.W_q")
DEVICES = 4
JAX_ONLY = pytest.mark.skipif(
    backend.BACKEND != "jax", reason="Keras lays variables out by a distribution on JAX only"
)
NOT_JAX = pytest.mark.skipif(backend.BACKEND == "jax", reason="the JAX backend shards")

#: The sharded configurations: the mesh (shape, axes), the layer's arguments,
#: the calls compared (``_call``) and whether the cache's prefill is called
#: eagerly (else compiled, as the decoding steps are). Grouped heads on a
#: (batch, model) mesh, split in two; grouped heads of an explicit size on a
#: 1-D mesh, split in four.
CONFIGS: dict[str, dict[str, Any]] = {
    "mesh_2x2": {
        "mesh": ((2, 2), ("batch", "model")),
        "layer": {"num_hiddens": 16, "num_heads": 4, "num_kv_heads": 2},
        "sizes": {"query_size": 8, "key_size": 6, "value_size": 7},
        "calls": ("lens_1d_gates", "lens_2d_causal_batch_gates_weights"),
        "eager_prefill": True,
    },
    "mesh_4": {
        "mesh": ((4,), ("model",)),
        "layer": {"num_hiddens": 20, "num_heads": 8, "num_kv_heads": 4, "head_dim": 3},
        "sizes": {"query_size": 20, "key_size": 20, "value_size": 20},
        # Fewer compilations: each takes seconds on a loaded machine.
        "calls": ("lens_2d_causal_batch_gates_weights",),
        "eager_prefill": False,
    },
}
BATCH, NUM_QUERIES, NUM_KEYS, MAX_LENGTH = 4, 5, 6, 12
ZEROS = {"kernel_initializer": "zeros", "bias_initializer": "zeros"}
SIZES_16 = {"query_size": 16, "key_size": 16, "value_size": 16}


# -- the checks, in a process of their own ----------------------------------------------------


def _max_abs(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0))


def _inputs(config: dict[str, Any], seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    sizes, heads = config["sizes"], config["layer"]["num_heads"]
    q = rng.standard_normal((BATCH, NUM_QUERIES, sizes["query_size"]), dtype=np.float32)
    k = rng.standard_normal((BATCH, NUM_KEYS, sizes["key_size"]), dtype=np.float32)
    v = rng.standard_normal((BATCH, NUM_KEYS, sizes["value_size"]), dtype=np.float32)
    return {
        "qkv": (q, k, v),
        "lens_1d": np.array([6, 4, 2, 0], np.int32),
        "lens_2d": rng.integers(0, NUM_KEYS + 1, (BATCH, NUM_QUERIES)).astype(np.int32),
        "gates": rng.uniform(0.0, 1.5, heads).astype(np.float32),
        "batch_gates": rng.uniform(0.0, 1.5, (BATCH, heads)).astype(np.float32),
        "cotangent": rng.standard_normal(
            (BATCH, NUM_QUERIES, config["layer"]["num_hiddens"]), dtype=np.float32
        ),
    }


def _call(name: str, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A call's ``valid_lens`` and keyword arguments."""
    if name == "lens_1d_gates":
        return data["lens_1d"], {"head_mask": data["gates"]}
    return data["lens_2d"], {
        "causal": True,
        "head_mask": data["batch_gates"],
        "return_attention_weights": True,
    }


def _spec(x: Any) -> list[Any]:
    """The mesh axes of each dimension of the JAX array ``x`` (``None``: whole)."""
    return [None if axes is None else str(axes) for axes in x.sharding.spec]


def _forward_collectives(
    layer: MultiHeadAttention, call: str, data: dict[str, Any], *inputs: Any
) -> dict[str, int]:
    """The collectives of the compiled forward of ``call``, by operation."""
    import jax

    lens, options = _call(call, data)

    def forward(trainable: list[Any], q: Any, k: Any, v: Any) -> Any:
        return layer.stateless_call(trainable, [], q, k, v, lens, **options)[0]

    values = [variable.value for variable in layer.trainable_variables]
    lines = jax.jit(forward).lower(values, *inputs).compile().as_text().splitlines()
    operations = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    return {op: sum(f" {op}(" in ln or f" {op}-start(" in ln for ln in lines) for op in operations}


def _config_checks(key: str, config: dict[str, Any], results: dict[str, Any]) -> None:
    """Sharded vs unsharded vs the float64 reference for one mesh and layer."""
    import jax

    shape, axes = config["mesh"]
    mesh = keras.distribution.DeviceMesh(shape, list(axes))
    batch_axis = "batch" if "batch" in axes else None
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map(mesh), batch_dim_name=batch_axis
    )
    # Zeros: set_weights writes the weights, and random initializers compile per shape.
    arguments = {**config["layer"], **config["sizes"], "bias": True, **ZEROS}
    heads = {n: config["layer"][n] for n in ("num_heads", "num_kv_heads")}
    weights = init_weights(
        config["layer"]["num_hiddens"],
        bias=True,
        seed=1,
        head_dim=config["layer"].get("head_dim"),
        **heads,
        **config["sizes"],
    )
    plain = set_weights(MultiHeadAttention(**arguments), weights)
    with distribution.scope():
        sharded = set_weights(MultiHeadAttention(**arguments), weights)
    results["shards"][key] = {
        name: {
            "shape": list(variable.shape),
            "shard": list(variable.value.sharding.shard_shape(tuple(variable.shape))),
            "devices": len(variable.value.sharding.device_set),
        }
        for name, variable in sharded.canonical_variables().items()
    }
    # Reading split variables gathers them.
    read = get_weights(sharded)
    results["max_abs"][f"{key}/get_weights"] = max(_max_abs(read[n], w) for n, w in weights.items())
    data = _inputs(config, seed=2)
    q, k, v = data["qkv"]
    if batch_axis is not None:
        # The data split over the batch axis, as Keras' trainer splits it.
        q, k, v = (
            keras.distribution.distribute_tensor(x, distribution.get_data_layout(x.shape))
            for x in (q, k, v)
        )
    errors = results["max_abs"]

    def loss_and_result(layer: MultiHeadAttention, call: str) -> Any:
        """``(trainable, q, k, v, gates) -> (sum(output * cotangent), result)``, compiled."""
        lens, options = _call(call, data)
        options = {n: value for n, value in options.items() if n != "head_mask"}

        def run(trainable: list[Any], q: Any, k: Any, v: Any, gates: Any) -> Any:
            result, _ = layer.stateless_call(
                trainable, [], q, k, v, lens, head_mask=gates, **options
            )
            output = result[0] if options.get("return_attention_weights") else result
            return (output * data["cotangent"]).sum(), result

        # One program per layer and call: the result and every gradient.
        return jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2, 3, 4), has_aux=True))

    for call in config["calls"]:
        lens, options = _call(call, data)
        flags = {"causal": options.get("causal", False), "head_mask": options["head_mask"]}
        expected, expected_weights = spec.reference_forward(
            weights, *data["qkv"], lens, **heads, **flags
        )
        reference = spec.reference_gradients(
            weights, *data["qkv"], lens, **heads, **flags, output_gradient=data["cotangent"]
        )
        outputs, grads = {}, {}
        for label, layer in (("sharded", sharded), ("plain", plain)):
            values = [variable.value for variable in layer.trainable_variables]
            names = [variable.name for variable in layer.trainable_variables]
            function = loss_and_result(layer, call)
            (_, result), grad = function(values, q, k, v, options["head_mask"])
            if options.get("return_attention_weights"):
                result, attention = result
                errors[f"{key}/{call}/weights/{label}-reference"] = _max_abs(
                    attention, expected_weights
                )
            outputs[label] = result
            errors[f"{key}/{call}/output/{label}-reference"] = _max_abs(result, expected)
            grads[label] = {
                **dict(zip(names, grad[0], strict=True)),
                **dict(zip(("queries", "keys", "values", "head_mask"), grad[1:], strict=True)),
            }
        errors[f"{key}/{call}/output/sharded-plain"] = _max_abs(
            outputs["sharded"], outputs["plain"]
        )
        results["output_sharding"][f"{key}/{call}"] = _spec(outputs["sharded"])
        results["collectives"][f"{key}/{call}"] = _forward_collectives(sharded, call, data, q, k, v)
        results["grad_sharding"][f"{key}/{call}"] = _spec(grads["sharded"]["W_q"])
        for name, expected_grad in reference.items():
            errors[f"{key}/{call}/grad.{name}/sharded-reference"] = _max_abs(
                grads["sharded"][name], expected_grad
            )
            errors[f"{key}/{call}/grad.{name}/sharded-plain"] = _max_abs(
                grads["sharded"][name], grads["plain"][name]
            )
    _cache_checks(key, distribution, sharded, weights, heads, data, results, config)


def _cache_checks(
    key: str,
    distribution: Any,
    sharded: MultiHeadAttention,
    weights: dict[str, np.ndarray],
    heads: dict[str, int],
    data: dict[str, Any],
    results: dict[str, Any],
    config: dict[str, Any],
) -> None:
    """A ragged prefill then two decoding steps (``jax.jit``) against the reference."""
    import jax

    q, k, v = data["qkv"]
    with distribution.scope():
        cache = sharded.init_cache(BATCH, MAX_LENGTH)
    results["cache_sharding"][f"{key}/init"] = _spec(cache.keys)
    reference_cache = spec.KVCache(*(np.asarray(x) for x in cache))

    @jax.jit
    def step(trainable: list[Any], x: tuple[Any, ...], lens: Any, cache: Any, gates: Any) -> Any:
        result, _ = sharded.stateless_call(
            trainable, [], *x, lens, causal=True, cache=cache, head_mask=gates
        )
        return result

    schedule = [  # (queries, keys, values, new lengths, gates)
        (q[:, :4], k[:, :4], v[:, :4], np.array([4, 2, 3, 0], np.int32), None),
        (q[:, 4:5], k[:, 4:5], v[:, 4:5], None, data["gates"]),
        (q[:, :1], k[:, 5:6], v[:, 5:6], None, np.ones_like(data["gates"])),
    ]
    errors = results["max_abs"]
    for index, (*x, lens, gates) in enumerate(schedule):
        expected, _, reference_cache = spec.reference_cached_forward(
            weights, *x, reference_cache, lens, **heads, causal=True, head_mask=gates
        )
        if index == 0 and config["eager_prefill"]:  # the layer called as it is
            with distribution.scope():
                out, cache = sharded(*x, lens, causal=True, cache=cache)
        else:
            trainable = [variable.value for variable in sharded.trainable_variables]
            out, cache = step(trainable, x, lens, cache, gates)
        # Positions past an example's new lengths are padding: compare the real ones.
        new = np.full(BATCH, out.shape[1]) if lens is None else lens
        real = (np.arange(out.shape[1])[None, :] < new[:, None])[..., None]
        errors[f"{key}/cache_{index}/output/sharded-reference"] = _max_abs(
            np.where(real, np.asarray(out), 0.0), np.where(real, expected, 0.0)
        )
        errors[f"{key}/cache_{index}/keys/sharded-reference"] = _max_abs(
            cache.keys, reference_cache.keys
        )
        results["lengths"][f"{key}/cache_{index}"] = np.asarray(cache.lengths).tolist()
        results["cache_sharding"][f"{key}/step_{index}"] = _spec(cache.keys)


def _error_checks(results: dict[str, Any]) -> None:
    """What a shard count that would split a head gives, wherever it is found."""
    mesh = keras.distribution.DeviceMesh((DEVICES,), ["model"])

    def attempt(label: str, make: Any) -> None:
        try:
            make()
        except Exception as error:  # the type is what is checked
            results["errors"][label] = [type(error).__name__, str(error)]
        else:
            results["errors"][label] = None

    distribution = keras.distribution.ModelParallel(layout_map=layout_map(mesh))

    def under_distribution(**arguments: Any) -> Any:
        with distribution.scope():
            return MultiHeadAttention(**arguments, **ZEROS)

    # 2 key/value heads over 4 devices: W_k's columns would divide, its heads not.
    attempt("kv_heads", lambda: under_distribution(num_hiddens=16, num_heads=4, num_kv_heads=2))
    # 3 heads of 2: W_q's 6 columns do not even divide into 4 blocks.
    attempt("columns", lambda: under_distribution(num_hiddens=6, num_heads=3, head_dim=2))
    attempt("good", lambda: under_distribution(num_hiddens=16, num_heads=4))
    # A layout of W_q alone, found at the first call (lazy sizes): the check in build.
    only_q = keras.distribution.LayoutMap(mesh)
    only_q[".*/W_q"] = (None, "model")
    lazy = keras.distribution.ModelParallel(layout_map=only_q)

    def lazy_layer() -> None:
        with lazy.scope():
            layer = MultiHeadAttention(12, 6, **ZEROS)
            x = np.ones((1, 2, 12), np.float32)
            layer(x, x, x)

    attempt("built", lazy_layer)
    # layout_map with the layer checks at once.
    template = MultiHeadAttention(16, 4, num_kv_heads=2, **ZEROS)
    attempt("layout_map_layer", lambda: layout_map(mesh, layer=template))
    attempt("layout_map_axis", lambda: layout_map(mesh, axis="heads"))
    # A norm of the whole projection couples every head: refused, at once and under a distribution.
    whole = {"scope": "whole"}
    attempt("whole_norm", lambda: under_distribution(num_hiddens=16, num_heads=4, qk_norm=whole))
    norm_template = MultiHeadAttention(16, 4, qk_norm=whole, **ZEROS)
    attempt("layout_map_whole_norm", lambda: layout_map(mesh, layer=norm_template))
    attempt("heads_norm", lambda: under_distribution(num_hiddens=16, num_heads=4, qk_norm={}))


def _nested_checks(results: dict[str, Any]) -> None:
    """Layers nested in a model, named: ``name=`` picks them, wherever they are."""
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map(mesh, name="self_attention"), batch_dim_name="batch"
    )

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.attention = MultiHeadAttention(
                16, 4, num_kv_heads=2, name="self_attention", **ZEROS
            )
            self.cross = MultiHeadAttention(16, 4, name="cross_attention", **ZEROS)

        def call(self, x: Any) -> Any:
            return self.cross(self.attention(x, x, x, causal=True), x, x)

    with distribution.scope():
        model = keras.Sequential(
            [keras.Input((3, 8)), keras.layers.Dense(16), Block(name="block")], name="model"
        )
    results["nested"] = {variable.path: _spec(variable.value) for variable in model.variables}
    with distribution.scope():  # input sizes still unknown: no W_k yet, its layout all the same
        lazy = MultiHeadAttention(16, 4, num_kv_heads=2, name="self_attention", **ZEROS)
        results["lazy_cache"] = _spec(lazy.init_cache(4, 3).keys)
        results["odd_batch_cache"] = _spec(lazy.init_cache(3, 3).keys)


def _fit_checks(results: dict[str, Any]) -> None:
    """One step of Keras' own trainer (``model.fit``) sharded and not, from the same weights."""
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map(mesh), batch_dim_name="batch"
    )

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.attention = MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, **ZEROS)

        def call(self, x: Any) -> Any:
            return self.attention(x, x, x, causal=True)

    def model() -> keras.Model:
        model = keras.Sequential([keras.Input((5, 8)), keras.layers.Dense(16), Block()])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        return model

    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 5, 8), dtype=np.float32)
    y = rng.standard_normal((8, 5, 16), dtype=np.float32)
    plain = model()
    plain.set_weights([rng.uniform(-0.5, 0.5, v.shape).astype(np.float32) for v in plain.variables])
    with distribution.scope():
        sharded = model()
    sharded.set_weights(plain.get_weights())
    before = plain.get_weights()
    plain.fit(x, y, batch_size=8, epochs=1, verbose=0)
    with distribution.scope():
        sharded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    results["fit"] = {
        variable.name: {
            "moved": _max_abs(variable.value, start),
            "sharded-plain": _max_abs(variable.value, other.value),
            "axes": _spec(variable.value),
        }
        for variable, other, start in zip(sharded.variables, plain.variables, before, strict=True)
    }


def sharded_checks() -> dict[str, Any]:
    """Every check of the JAX backend; needs ``DEVICES`` devices."""
    import jax

    results: dict[str, Any] = {
        "devices": jax.device_count(),
        "max_abs": {},
        "shards": {},
        "output_sharding": {},
        "collectives": {},
        "grad_sharding": {},
        "cache_sharding": {},
        "lengths": {},
        "errors": {},
    }
    for key, config in CONFIGS.items():
        _config_checks(key, config, results)
    _error_checks(results)
    _nested_checks(results)
    _fit_checks(results)
    _sinks_checks(results)
    return results


def _sinks_checks(results: dict[str, Any]) -> None:
    """Each head's sink logit goes with its head (``layout_map``), to the reference's output."""
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map(mesh), batch_dim_name="batch"
    )
    weights = init_weights(16, num_heads=4, num_kv_heads=2, sinks=True, seed=4)
    weights["sinks"] = np.array([1.0, -1.0, 0.5, 2.0], np.float32)
    with distribution.scope():
        layer = MultiHeadAttention(16, 4, num_kv_heads=2, sinks=True, **SIZES_16)
        set_weights(layer, weights)
    x = np.random.default_rng(5).standard_normal((4, 3, 16)).astype(np.float32)
    lens = np.array([3, 0, 2, 1], np.int32)
    expected, _ = spec.reference_forward(weights, x, x, x, lens, num_heads=4, sinks=True)
    results["sinks"] = {
        "spec": _spec(layer.sinks.value),
        "output": float(np.abs(np.asarray(layer(x, x, x, lens)) - expected).max()),
    }


# -- the JAX backend: the checks' results -----------------------------------------------------


def run_worker() -> dict[str, Any]:
    """The sharded checks' results, from a process where JAX sees several CPU devices."""
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={DEVICES}".strip(),
        "JAX_PLATFORMS": "cpu",
    }
    process = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", name="results")
def sharded_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # Imported here: this file also runs as the worker's script, without tests/fixtures.
    from computed_once import computed_once

    return computed_once(tmp_path_factory, "keras-sharding", run_worker)


@JAX_ONLY
def test_the_checks_ran_on_four_devices(results: dict[str, Any]) -> None:
    assert results["devices"] == DEVICES


@JAX_ONLY
@pytest.mark.parametrize("key", CONFIGS)
def test_variables_are_split_by_heads(results: dict[str, Any], key: str) -> None:
    (mesh_shape, axes), shards = CONFIGS[key]["mesh"], results["shards"][key]
    n = mesh_shape[axes.index("model")]
    for name, shard in shards.items():
        rows, *columns = shard["shape"]
        expected = {
            "W_q": [rows, columns[0] // n] if columns else None,
            "W_k": [rows, columns[0] // n] if columns else None,
            "W_v": [rows, columns[0] // n] if columns else None,
            "b_q": [rows // n],
            "b_k": [rows // n],
            "b_v": [rows // n],
            "W_o": [rows // n, *columns],
            "b_o": [rows],
        }[name]
        assert shard["shard"] == expected, (name, shard)
        assert shard["devices"] == DEVICES, (name, shard)
    assert set(shards) == {f"{w}_{p}" for w in "Wb" for p in "qkvo"}


@JAX_ONLY
def test_sharded_equals_unsharded_and_the_reference(results: dict[str, Any]) -> None:
    errors = results["max_abs"]
    expected = {
        f"{key}/{call}/output/{label}-reference"
        for key, config in CONFIGS.items()
        for call in config["calls"]
        for label in ("sharded", "plain")
    }
    assert expected | {f"{key}/get_weights" for key in CONFIGS} <= set(errors)
    for name, error in errors.items():
        limit = GRAD_ATOL if "/grad." in name else ATOL
        assert error <= limit, (name, error, limit)


@JAX_ONLY
def test_gradients_of_every_weight_input_and_gate(results: dict[str, Any]) -> None:
    names = {name.split("/")[2] for name in results["max_abs"] if "/grad." in name}
    weights = {f"grad.{w}_{p}" for w in "Wb" for p in "qkvo"}
    assert names == weights | {"grad.queries", "grad.keys", "grad.values", "grad.head_mask"}


@JAX_ONLY
def test_data_and_heads_stay_split_in_the_computation(results: dict[str, Any]) -> None:
    # The batch axis splits the examples of the output; the gradient of W_q
    # comes out split by heads, as W_q is.
    for call, axes in results["output_sharding"].items():
        assert axes[:1] == (["batch"] if call.startswith("mesh_2x2") else []), (call, axes)
    for call, axes in results["grad_sharding"].items():
        assert axes == [None, "model"], (call, axes)


@JAX_ONLY
def test_each_device_attends_with_its_own_heads(results: dict[str, Any]) -> None:
    # One all-reduce after W_o and nothing else: no device gathers another's
    # projected heads (docs: "Sharding heads").
    assert results["collectives"]
    for call, counts in results["collectives"].items():
        assert counts["all-reduce"] == 1 and sum(counts.values()) == 1, (call, counts)


@JAX_ONLY
@pytest.mark.parametrize("key", CONFIGS)
def test_cache_is_split_by_heads_and_decodes(results: dict[str, Any], key: str) -> None:
    batch = "batch" if key == "mesh_2x2" else None
    stages = {s: axes for s, axes in results["cache_sharding"].items() if s.startswith(key)}
    assert len(stages) == 4
    for stage, axes in stages.items():
        assert axes[:2] == [batch, "model"] and not any(axes[2:]), (stage, axes)
    lengths = [results["lengths"][f"{key}/cache_{i}"] for i in range(3)]
    assert lengths == [[4, 2, 3, 0], [5, 3, 4, 1], [6, 4, 5, 2]]
    assert all(f"{key}/cache_{i}/output/sharded-reference" in results["max_abs"] for i in range(3))


@JAX_ONLY
def test_a_count_that_splits_heads_is_a_value_error(results: dict[str, Any]) -> None:
    errors = results["errors"]
    assert errors["good"] is None
    for label, names in (
        ("kv_heads", ("W_o", "num_kv_heads (2)")),
        ("columns", ("W_o", "num_heads (3)")),
        ("built", ("W_q", "num_heads (6)")),
        ("layout_map_layer", ("num_kv_heads (2)",)),
    ):
        kind, message = errors[label]
        assert kind == "ValueError", (label, message)
        assert all(name in message for name in names), (label, message)
        assert "shards (4)" in message, (label, message)
    kind, message = errors["layout_map_axis"]
    assert kind == "ValueError" and "'heads'" in message and "['model']" in message
    assert errors["heads_norm"] is None  # per-head norms: whole on every device
    for label in ("whole_norm", "layout_map_whole_norm"):
        kind, message = errors[label]
        assert kind == "ValueError", (label, message)
        assert "sharding heads is not possible with qk_norm" in message, (label, message)


@JAX_ONLY
def test_nested_layers_are_matched_by_name(results: dict[str, Any]) -> None:
    nested = results["nested"]
    split = {p: axes for p, axes in nested.items() if "/self_attention/" in f"/{p}"}
    assert {p.rsplit("/", 1)[1] for p in split} == {"W_q", "W_k", "W_v", "W_o"}
    assert any(p.startswith("model/block/") for p in split)  # built inside its parents
    for path, axes in nested.items():
        assert ("model" in axes) == (path in split), (path, axes)
    # A cache split by heads before the layer is built; over the batch axis
    # only where the batch divides into it.
    assert results["lazy_cache"] == ["batch", "model", None, None]
    assert results["odd_batch_cache"] == [None, "model", None, None]


@JAX_ONLY
def test_sinks_are_split_with_their_heads(results: dict[str, Any]) -> None:
    assert results["sinks"]["spec"] == ["model"]
    assert results["sinks"]["output"] <= ATOL


@JAX_ONLY
def test_keras_training_step_sharded_equals_unsharded(results: dict[str, Any]) -> None:
    fit = results["fit"]
    assert {f"{w}_{p}" for w in "Wb" for p in "qkvo"} <= set(fit)
    for name, variable in fit.items():
        # The step changed it; but b_k, which shifts a query's scores all
        # alike, leaves the softmax unchanged and gets no gradient.
        assert (variable["moved"] > 1e-3) == (name != "b_k"), (name, variable)
        assert variable["sharded-plain"] <= ATOL, (name, variable)
        split = name in {"W_q", "W_k", "W_v", "b_q", "b_k", "b_v", "W_o"}
        assert ("model" in variable["axes"]) == split, (name, variable)


# -- TensorFlow and PyTorch: Keras ignores the distribution -----------------------------------


@NOT_JAX
def test_layout_map_names_the_backend() -> None:
    mesh = keras.distribution.DeviceMesh((1,), ["model"], devices=["cpu:0"])
    with pytest.raises(
        NotImplementedError, match=f"'{backend.BACKEND}' backend.*KERAS_BACKEND=jax"
    ):
        layout_map(mesh)


@NOT_JAX
def test_a_layer_under_a_distribution_stays_whole() -> None:
    # A hand-made layout that would split 2 key/value heads in 4: Keras does
    # not split them here, so the layer neither refuses nor changes a number.
    mesh = keras.distribution.DeviceMesh((1,), ["model"], devices=["cpu:0"])
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*/W_k"] = (None, "model")
    layouts[".*/W_o"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layouts)
    weights = init_weights(16, num_heads=4, num_kv_heads=2, seed=0)
    with distribution.scope():
        layer = set_weights(MultiHeadAttention(16, 4, num_kv_heads=2), weights)
        x = np.random.default_rng(0).standard_normal((2, 3, 16), dtype=np.float32)
        out, cache = layer(x, x, x, causal=True, cache=layer.init_cache(2, 4))
    expected, _ = spec.reference_forward(weights, x, x, x, num_heads=4, causal=True)
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=0, atol=ATOL)
    assert tuple(backend.to_numpy(layer.W_k.value).shape) == (16, 8)
    assert tuple(cache.keys.shape) == (2, 2, 4, 4)


def test_the_benchmark_refuses_a_count_that_splits_heads() -> None:
    from mha_multi.bench.common import Shape
    from mha_multi.bench.keras import sharded_seconds

    with pytest.raises(ValueError, match=r"shards \(4\) must divide num_heads \(6\)"):
        sharded_seconds(Shape(num_hiddens=48, num_heads=6), 4)


if __name__ == "__main__":
    print(json.dumps(sharded_checks()))
