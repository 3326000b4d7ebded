"""Heads on the active Keras backend: ``head_mask``, ``head_importance``, pruning.

The parity cases ``head_mask`` and ``head_mask_gqa`` check the gated output
and gradients through the runners. These tests check what is Keras' own:
the gates on the fused and generic paths (the kernel still taken where the
plan says), with a cache, in compiled code (``tf.function(jit_compile=True)``,
``jax.jit`` of ``stateless_call``, ``torch.compile``), 16-bit layers, the
gates' gradient, the spec's errors, :func:`mha_multi.keras.head_importance`
and layers pruned by :func:`mha_multi.heads.prune_heads`; every number
against the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from keras_testing import keras_runner  # noqa: E402, F401

from mha_multi import heads, spec  # noqa: E402
from mha_multi.keras import KVCache, MultiHeadAttention, head_importance, set_weights  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402
from mha_multi.weights import init_weights  # noqa: E402

#: The runner sets the process up (exact float32 products, float64 on JAX).
pytestmark = pytest.mark.usefixtures("runner")

ATOL = 5e-6  # float32, forward
GRAD_ATOL = 5e-5  # float32, gradients
#: Where the default float32 call takes the fused kernel (docs: "Fast paths").
FUSED = backend.BACKEND == "torch"

#: Grouped heads with biases: 8 query heads of size 4 reading 2 key/value heads.
GQA = {"num_hiddens": 32, "num_heads": 8, "num_kv_heads": 2}
MHA = {"num_hiddens": 16, "num_heads": 4}


def setup(config, seed=0, batch=3, num_queries=5, num_keys=7):
    """Weights, the layer holding them, and numpy inputs and lengths."""
    weights = init_weights(config["num_hiddens"], bias=True, seed=seed, **_heads(config))
    layer = set_weights(MultiHeadAttention(**config, bias=True), weights)
    rng = np.random.default_rng(seed + 100)
    q = rng.standard_normal((batch, num_queries, config["num_hiddens"])).astype(np.float32)
    k, v = (
        rng.standard_normal((batch, num_keys, config["num_hiddens"])).astype(np.float32)
        for _ in range(2)
    )
    lens = np.array([num_keys, 3, 1][:batch])
    return weights, layer, (q, k, v), lens


def _heads(config):
    return {name: config[name] for name in ("num_heads", "num_kv_heads") if name in config}


def gates_of(config, batched, seed=1):
    rng = np.random.default_rng(seed)
    shape = (3, config["num_heads"]) if batched else (config["num_heads"],)
    gates = rng.uniform(-1.5, 1.5, shape).astype(np.float32)
    gates[..., 1] = 0.0  # one head off
    return gates


def tensors(*arrays, dtype="float32"):
    return [backend.to_native(x, dtype=dtype) for x in arrays]


# -- the gates on every path ---------------------------------------------------------


@pytest.mark.parametrize("config", [MHA, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize("batched", [False, True], ids=["per_head", "per_example"])
@pytest.mark.parametrize("causal", [False, True], ids=["lens", "causal"])
def test_gates_on_the_fused_and_generic_paths(config, batched, causal):
    weights, layer, inputs, lens = setup(config)
    gates = gates_of(config, batched)
    expected, expected_weights = spec.reference_forward(
        weights, *inputs, lens, **_heads(config), causal=causal, head_mask=gates
    )
    args = (*tensors(*inputs), backend.lens_to_native(lens))
    with backend.kernel_spy() as calls:
        output = layer(*args, causal=causal, head_mask=backend.to_native(gates))
    assert len(calls) == int(FUSED)  # the gates do not move the call off the kernel
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=ATOL)
    with backend.kernel_spy() as calls:
        output, weights_out = layer(
            *args, causal=causal, head_mask=gates, return_attention_weights=True
        )
    assert calls == []
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=ATOL)
    # The attention weights are the heads' own, before any gate.
    np.testing.assert_allclose(backend.to_numpy(weights_out), expected_weights, rtol=0, atol=ATOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_layers_take_gates_of_any_float_dtype(dtype):
    weights, _, inputs, lens = setup(GQA)
    layer = set_weights(MultiHeadAttention(**GQA, bias=True, dtype=dtype), weights)
    gates = gates_of(GQA, batched=True)
    expected, _ = spec.reference_forward(weights, *inputs, lens, **_heads(GQA), head_mask=gates)
    args = (*tensors(*inputs, dtype=dtype), backend.lens_to_native(lens))
    for mask in (backend.to_native(gates), backend.to_native(gates, dtype="float64"), gates):
        output = layer(*args, head_mask=mask)
        assert backend.as_numpy(output).dtype.itemsize == 2
        np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=2e-2)


def test_gates_with_a_cache():
    # A ragged prefill, then one step, each gated per example.
    weights, layer, (q, k, v), _ = setup(GQA, num_queries=4, num_keys=4)
    gates = gates_of(GQA, batched=True)
    cache = layer.init_cache(3, 6)
    reference_cache = KVCache(*(backend.to_numpy(x) for x in cache))
    for part, new in ((slice(0, 3), [3, 2, 0]), (slice(3, 4), [1, 1, 1])):
        new = np.array(new)
        chunk = [x[:, part] for x in (q, k, v)]
        expected, _, reference_cache = spec.reference_cached_forward(
            weights, *chunk, reference_cache, new, **_heads(GQA), causal=True, head_mask=gates
        )
        with backend.kernel_spy() as calls:
            output, cache = layer(
                *tensors(*chunk),
                backend.lens_to_native(new),
                causal=True,
                cache=cache,
                head_mask=backend.to_native(gates),
            )
        # (One query per example: the generic path on the host.)
        assert len(calls) == int(FUSED and chunk[0].shape[1] > 1)
        real = np.arange(chunk[0].shape[1]) < new[:, None]
        np.testing.assert_allclose(
            backend.to_numpy(output)[real], expected[real], rtol=0, atol=ATOL
        )
    # Attending to the cache as it is, with one gate per head.
    per_head = gates_of(GQA, batched=False)
    expected, _, _ = spec.reference_cached_forward(
        weights, q[:, :1], None, None, reference_cache, **_heads(GQA), head_mask=per_head
    )
    output, _ = layer(
        *tensors(q[:, :1]), None, None, cache=cache, head_mask=backend.to_native(per_head)
    )
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=ATOL)


def test_gates_in_compiled_code(monkeypatch):
    """``tf.function(jit_compile=True)``, ``jax.jit`` of ``stateless_call``; on PyTorch
    what the layer does while ``torch.compile`` traces it (values unreadable),
    without paying for a compiler (half a minute for this call)."""
    weights, layer, inputs, lens = setup(GQA)
    gates = gates_of(GQA, batched=True)
    expected, _ = spec.reference_forward(
        weights, *inputs, lens, **_heads(GQA), causal=True, head_mask=gates
    )

    def arguments(q, k, v, head_mask, valid_lens):
        return (q, k, v, valid_lens), {"causal": True, "head_mask": head_mask}

    call = backend.LayerCall(layer, arguments)
    args = (*tensors(*inputs, gates), backend.lens_to_native(lens))
    if backend.BACKEND == "torch":
        import torch

        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    really = backend.BACKEND != "torch"
    compiled = backend.forward_function(call, compiled=really)
    with backend.kernel_spy() as calls:
        output = compiled(backend.state(layer), *args)
    assert calls == []  # values unreadable: the generic path
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=ATOL)
    # The gates' gradient, compiled too.
    gradient = backend.gradient_function(call, wrt=4, compiled=really)
    cotangent = np.random.default_rng(3).standard_normal(expected.shape).astype(np.float32)
    reference = spec.reference_gradients(
        weights,
        *inputs,
        lens,
        **_heads(GQA),
        causal=True,
        head_mask=gates,
        output_gradient=cotangent,
    )
    input_grads, _ = gradient(backend.state(layer), args, backend.to_native(cotangent))
    np.testing.assert_allclose(
        backend.to_numpy(input_grads[3]), reference["head_mask"], rtol=0, atol=GRAD_ATOL
    )


# -- the gradient --------------------------------------------------------------------


@pytest.mark.parametrize("config", [MHA, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize("batched", [False, True], ids=["per_head", "per_example"])
def test_gradients_with_gates_match_the_reference(config, batched):
    weights, layer, inputs, lens = setup(config)
    gates = gates_of(config, batched)
    cotangent = np.random.default_rng(4).standard_normal((3, 5, config["num_hiddens"]))
    cotangent = cotangent.astype(np.float32)
    reference = spec.reference_gradients(
        weights, *inputs, lens, **_heads(config), head_mask=gates, output_gradient=cotangent
    )
    with backend.kernel_spy() as calls:
        grads = backend.vjp(
            layer,
            *tensors(*inputs),
            backend.lens_to_native(lens),
            causal=False,
            output_gradient=backend.to_native(cotangent),
            head_mask=backend.to_native(gates),
        )
    if backend.BACKEND == "torch":
        assert len(calls) == 1  # differentiated through the kernel
    assert set(grads) == set(reference)
    assert tuple(grads["head_mask"].shape) == gates.shape
    for name, expected in reference.items():
        np.testing.assert_allclose(
            backend.to_numpy(grads[name]), expected, rtol=0, atol=GRAD_ATOL, err_msg=name
        )


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "error", "message"),
    [
        (np.ones(5, np.float32), ValueError, r"head_mask must have shape \(num_heads,\)"),
        (np.ones((2, 4), np.float32), ValueError, r"\(batch, num_heads\) = \(3, 4\)"),
        (np.ones((3, 4, 1), np.float32), ValueError, "head_mask must have shape"),
        (np.ones(4, np.int32), TypeError, "head_mask must be a floating-point"),
        ("int tensor", TypeError, "head_mask must be a floating-point"),
        ([1.0, 1.0, 0.0, 1.0], TypeError, "head_mask must be a tensor or a numpy array"),
    ],
)
@pytest.mark.parametrize("cached", [False, True], ids=["call", "cached"])
def test_bad_masks_are_the_spec_errors(mask, error, message, cached):
    _, layer, inputs, _ = setup(MHA, num_queries=4, num_keys=4)
    if isinstance(mask, str):
        mask = keras.ops.ones((4,), "int32")
    kwargs = {"cache": layer.init_cache(3, 6)} if cached else {}
    with pytest.raises(error, match=message):
        layer(*tensors(*inputs), head_mask=mask, **kwargs)


# -- head importance ------------------------------------------------------------------


def importance_batches(config, seed=5):
    """Two batches of their own sizes and lengths, and the loss's cotangents."""
    rng = np.random.default_rng(seed)
    batches = []
    for batch, num_queries, num_keys, lens in ((3, 5, 7, [7, 2, 0]), (2, 4, 4, None)):
        arrays = [
            rng.standard_normal((batch, t, config["num_hiddens"])).astype(np.float32)
            for t in (num_queries, num_keys, num_keys)
        ]
        cotangent = rng.standard_normal((batch, num_queries, config["num_hiddens"]))
        batches.append((arrays, None if lens is None else np.array(lens), cotangent))
    return batches


@pytest.mark.parametrize("config", [MHA, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize(("normalize", "arrays"), [(True, "tensors"), (False, "numpy")])
def test_head_importance_matches_the_reference(config, normalize, arrays):
    """Batches of tensors, or of numpy arrays as the layer takes them (on JAX and PyTorch
    the gates' placement asked numpy arrays their device: ``AttributeError``)."""
    weights, layer, _, _ = setup(config, seed=2)
    batches = importance_batches(config)
    ones = np.ones(config["num_heads"])
    expected = heads.importance(
        [
            spec.reference_gradients(
                weights, *arrays, lens, **_heads(config), head_mask=ones, output_gradient=g
            )["head_mask"]
            for arrays, lens, g in batches
        ],
        normalize=normalize,
    )
    # loss = sum(output * G) makes dL/doutput = G, batch by batch.
    cotangents = iter(backend.to_native(g) for _, _, g in batches)

    def loss_fn(output):
        return keras.ops.sum(output * next(cotangents))

    native = (
        (*tensors(*inputs), None if lens is None else backend.lens_to_native(lens))
        for inputs, lens, _ in batches
    )
    given = native if arrays == "tensors" else ((*inputs, lens) for inputs, lens, _ in batches)
    importance = head_importance(layer, given, loss_fn, normalize=normalize)
    assert importance.shape == (config["num_heads"],)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(importance), 1.0, rtol=1e-6)
    np.testing.assert_allclose(importance, expected, rtol=1e-5, atol=GRAD_ATOL)


# -- pruned layers --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "pruned"),
    [
        (MHA, [1, 2]),
        (MHA, [0, 1, 3]),  # down to one head
        (GQA, [4, 5, 6, 7]),  # a whole group of grouped heads
        ({**GQA, "num_kv_heads": 4}, [0, 1, 6, 7]),
    ],
    ids=["mha", "one_head", "gqa_group", "gqa_two_groups"],
)
def test_a_pruned_layer_is_the_full_layer_with_those_gates_at_zero(config, pruned):
    weights, _, inputs, lens = setup(config, seed=3)
    gates = np.ones(config["num_heads"], np.float32)
    gates[pruned] = 0.0
    expected, _ = spec.reference_forward(
        weights, *inputs, lens, **_heads(config), causal=True, head_mask=gates
    )
    smaller, layer_config = heads.prune_heads(weights, pruned, **_heads(config))
    layer = set_weights(MultiHeadAttention(**layer_config.kwargs()), smaller)
    assert layer.num_heads == config["num_heads"] - len(pruned)
    output = layer(*tensors(*inputs), backend.lens_to_native(lens), causal=True)
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=ATOL)
