"""The MXNet layer's heads (docs: "Heads"): ``head_mask`` on both routes, with a
cache and in hybridized and exported graphs, its gradient, ``head_importance``
and pruned layers, against the float64 reference.

The parity cases with gates (every dtype, both runners) are tests/backends'.
"""

from __future__ import annotations

import json
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet_support import (
    HYBRID,
    IMPERATIVE,
    KV_HEADS,
    NUM_HEADS,
    NUM_HIDDENS,
    QUERY_SIZE,
    layer_of,
    layout_inputs,
    layout_weights,
    reference_heads,
)

from mha_multi import heads, spec
from mha_multi.mxnet import MultiHeadAttention, head_importance, set_weights
from mha_multi.mxnet._graph import AttentionGraph
from mha_multi.mxnet._kernel import SEQUENCE_MASK
from mha_multi.parity.compare import tolerance
from mha_multi.parity.harness import KernelCall
from mha_multi.parity.harness import mxnet as backend
from mha_multi.weights import KERNEL_NAMES

RUNNERS = pytest.mark.parametrize("runner", [IMPERATIVE, HYBRID], ids=lambda r: r.name)
#: The layouts here: multi-head and grouped attention.
KINDS = ["mha", "gqa"]
#: Per-example key lengths: one example sees a prefix, one everything, one nothing.
LENS = np.array([2, 6, 0])
#: Gates: one head off, one halved, one negated; and per-example gates.
GATES = {
    1: np.array([1.0, 0.0, 0.5, -2.0]),
    2: np.array([[1.0, 1.0, 0.0, 0.0], [0.5, -1.0, 2.0, 0.25], [0.0, 1.0, 1.0, 3.0]]),
}
ATOL = tolerance("float32", "output")
GRAD_ATOL = tolerance("float32", "grad.head_mask")


def weights_and_inputs(kind, seed=0, batch=3, num_queries=4, num_keys=6):
    return layout_weights(kind, seed), layout_inputs(seed, batch, num_queries, num_keys)


def native(x, dtype="float32"):
    return mx.np.array(x, dtype=dtype)


def natives(inputs, dtype="float32"):
    return [native(inputs[name], dtype) for name in ("queries", "keys", "values")]


def reference(weights, inputs, kind, lens=LENS, **kwargs):
    return spec.reference_forward(
        weights, *inputs.values(), lens, **reference_heads(kind), **kwargs
    )


def assert_close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(backend.to_numpy(actual), expected, rtol=0, atol=atol)


@RUNNERS
@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_head_mask_on_the_fast_route_and_the_generic_one(runner, kind, ndim):
    weights, inputs = weights_and_inputs(kind)
    layer = layer_of(runner, kind, weights)
    gates = native(GATES[ndim])
    plan = spec.plan_kernel(
        SEQUENCE_MASK,
        sizes=(3, 4, 6),
        lens_ndim=1,
        causal=True,
        dropout=False,
        return_attention_weights=False,
        grouped=kind != "mha",
    )
    assert plan.fused and plan.needs_mask
    with runner.kernel_spy() as calls:
        output = layer(*natives(inputs), native(LENS), causal=True, head_mask=gates)
    # The gates act after the kernel: the plan is the one without them.
    assert calls == [KernelCall(mask=True, is_causal=False)]
    with runner.kernel_spy() as calls:
        generic, weights_out = layer(
            *natives(inputs),
            native(LENS),
            causal=True,
            head_mask=gates,
            return_attention_weights=True,
        )
    assert calls == []
    expected, expected_weights = reference(
        weights, inputs, kind, causal=True, head_mask=GATES[ndim]
    )
    assert_close(output, expected)
    assert_close(generic, expected)
    assert_close(weights_out, expected_weights)  # the gates act after the weights
    # Without gates the same layer is ungated again (another graph when hybridized).
    assert_close(
        layer(*natives(inputs), native(LENS), causal=True),
        reference(weights, inputs, kind, causal=True)[0],
    )


@RUNNERS
@pytest.mark.parametrize(
    ("dtype", "gates_dtype"),
    [
        ("float32", "float64"),
        ("float32", "float16"),
        ("float16", "float32"),
        ("float64", "float32"),
    ],
)
def test_gates_of_another_dtype_are_cast_to_the_layers(runner, dtype, gates_dtype):
    # The gates are cast to the layer's dtype (16-bit layers included); the
    # cast is recorded, so their gradient comes back in their own dtype.
    weights, inputs = weights_and_inputs("gqa")
    layer = layer_of(runner, "gqa", weights, dtype=dtype)
    gates = native(GATES[2], gates_dtype)
    exact_gates = backend.to_numpy(gates)  # what float16 gates hold
    output_gradient = np.random.default_rng(1).standard_normal((3, 4, NUM_HIDDENS))
    grads = backend.vjp(
        layer,
        *natives(inputs, dtype),
        native(LENS),
        causal=False,
        output_gradient=native(output_gradient, dtype),
        head_mask=gates,
    )
    expected = spec.reference_gradients(
        weights,
        *inputs.values(),
        LENS,
        **reference_heads("gqa"),
        head_mask=exact_gates,
        output_gradient=output_gradient,
    )
    assert np.dtype(grads["head_mask"].dtype) == np.dtype(gates_dtype)
    # The gradient is the layer's, rounded to the gates' dtype.
    atol = max(tolerance(dtype, "grad.head_mask"), tolerance(gates_dtype, "grad.head_mask"))
    assert_close(grads["head_mask"], expected["head_mask"], atol)
    output = layer(*natives(inputs, dtype), native(LENS), head_mask=gates)
    assert np.dtype(output.dtype) == np.dtype(dtype)
    assert_close(
        output,
        reference(weights, inputs, "gqa", head_mask=exact_gates)[0],
        tolerance(dtype, "output"),
    )


def gradients(layer, inputs, lens, gates, output_gradient, **kwargs):
    """Every gradient of ``sum(output * output_gradient)``, by Gluon, canonical names."""
    arrays = {name: native(x) for name, x in inputs.items()} | {"head_mask": gates}
    for array in arrays.values():
        array.attach_grad()
    with autograd.record(train_mode=False):
        result = layer(
            arrays["queries"],
            arrays["keys"],
            arrays["values"],
            native(lens),
            head_mask=arrays["head_mask"],
            **kwargs,
        )
    output = result[0] if isinstance(result, tuple) else result
    output.backward(native(output_gradient))
    grads = {name: array.grad for name, array in arrays.items()}
    for name in KERNEL_NAMES:
        dense = getattr(layer, name)
        grads[name] = dense.weight.grad().T
        grads[f"b_{name[-1]}"] = dense.bias.grad()
    return {name: backend.to_numpy(value) for name, value in grads.items()}


@RUNNERS
@pytest.mark.parametrize("return_attention_weights", [False, True], ids=["fast", "generic"])
@pytest.mark.parametrize(("kind", "ndim"), [("mha", 1), ("gqa", 2)])
def test_gradients_are_the_references(runner, kind, ndim, return_attention_weights):
    weights, inputs = weights_and_inputs(kind)
    layer = layer_of(runner, kind, weights)
    output_gradient = np.random.default_rng(2).standard_normal((3, 4, NUM_HIDDENS))
    grads = gradients(
        layer,
        inputs,
        LENS,
        native(GATES[ndim]),
        output_gradient,
        causal=True,
        return_attention_weights=return_attention_weights,
    )
    expected = spec.reference_gradients(
        weights,
        *inputs.values(),
        LENS,
        **reference_heads(kind),
        causal=True,
        head_mask=GATES[ndim],
        output_gradient=output_gradient,
    )
    assert set(grads) == set(expected)
    for name, value in expected.items():
        assert_close(grads[name], value, GRAD_ATOL)


@RUNNERS
@pytest.mark.parametrize("kind", KINDS)
def test_head_mask_with_a_cache(runner, kind):
    weights, inputs = weights_and_inputs(kind, num_queries=6)
    lengths = np.array([5, 2, 6])
    chunks = [(3, [3, 2, 1]), (1, [1, 0, 1]), (2, [1, 0, 2]), (2, [0, 0, 2])]
    layer = layer_of(runner, kind, weights)
    expected = reference(weights, inputs, kind, lens=lengths, causal=True, head_mask=GATES[2])[0]
    real = np.arange(6) < lengths[:, None]
    for return_attention_weights in (False, True):
        decoded = runner.decode(
            layer,
            inputs,
            lengths,
            chunks,
            max_length=7,
            head_mask=native(GATES[2]),
            return_attention_weights=return_attention_weights,
        )
        np.testing.assert_allclose(decoded[real], expected[real], rtol=0, atol=ATOL)

    # A call without keys attends to the cache as it is, gated.
    cache = layer.init_cache(3, 7)
    _, cache = layer(*natives(inputs), native(lengths, "int32"), causal=True, cache=cache)
    queries = np.random.default_rng(3).standard_normal((3, 2, QUERY_SIZE))
    output, cache_after = layer(
        native(queries), None, None, cache=cache, head_mask=native(GATES[1])
    )
    expected, _, _ = spec.reference_cached_forward(
        weights,
        queries,
        None,
        None,
        spec.KVCache(*(backend.to_numpy(x) for x in cache)),
        **reference_heads(kind),
        head_mask=GATES[1],
    )
    assert_close(output, expected)
    assert cache_after.lengths.asnumpy().tolist() == lengths.tolist()


@RUNNERS
def test_gradients_through_a_cached_call(runner):
    # A prefill into an empty cache is the causal forward with its new
    # lengths: the gradients at its real positions are the reference's.
    weights, inputs = weights_and_inputs("gqa")
    inputs = {name: x[:, :4] for name, x in inputs.items()}
    new_lens = np.array([4, 1, 3])
    output_gradient = np.random.default_rng(4).standard_normal((3, 4, NUM_HIDDENS))
    output_gradient *= (np.arange(4) < new_lens[:, None])[..., None]
    layer = layer_of(runner, "gqa", weights)
    grads = backend.vjp(
        layer,
        *natives(inputs),
        native(new_lens, "int32"),
        causal=True,
        output_gradient=native(output_gradient),
        cache=layer.init_cache(3, 5),
        head_mask=native(GATES[2]),
    )
    expected = spec.reference_gradients(
        weights,
        *inputs.values(),
        new_lens,
        **reference_heads("gqa"),
        causal=True,
        head_mask=GATES[2],
        output_gradient=output_gradient,
    )
    for name in ("head_mask", "queries", "keys", "values", "W_q", "W_o"):
        assert_close(grads[name], expected[name], GRAD_ATOL)


def test_hybridized_graphs_take_the_gates_as_an_input(tmp_path, monkeypatch):
    traced = []
    original = AttentionGraph.hybrid_forward

    def tracing(graph, F, *args, **kwargs):
        if F is mx.sym:
            traced.append(graph._config.head_mask_ndim)
        return original(graph, F, *args, **kwargs)

    monkeypatch.setattr(AttentionGraph, "hybrid_forward", tracing)
    weights, inputs = weights_and_inputs("gqa")
    layer = layer_of(HYBRID, "gqa", weights)
    rng = np.random.default_rng(5)
    for _ in range(2):  # new gates, one graph
        gates = rng.standard_normal(NUM_HEADS)
        output = layer(*natives(inputs), native(LENS), head_mask=native(gates))
        assert_close(output, reference(weights, inputs, "gqa", head_mask=gates)[0])
    output = layer(*natives(inputs), native(LENS), head_mask=native(GATES[2]))
    assert traced == [1, 2]

    # The exported graph: queries, keys, values, valid_lens, then the gates.
    prefix = str(tmp_path / "gated")
    layer.export(prefix)
    with open(f"{prefix}-symbol.json") as file:
        names = [node["name"] for node in json.load(file)["nodes"] if node["op"] == "null"]
    assert sorted(name for name in names if name.startswith("data")) == [
        f"data{i}" for i in range(5)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # SymbolBlock guesses the inputs' types
        graph = gluon.SymbolBlock.imports(
            f"{prefix}-symbol.json", [f"data{i}" for i in range(5)], f"{prefix}-0000.params"
        )
    gates = rng.standard_normal((3, NUM_HEADS))
    output = graph(*natives(inputs), native(LENS), native(gates))
    assert_close(output, reference(weights, inputs, "gqa", head_mask=gates)[0])


BAD_MASKS = {
    "list": ([1.0, 1.0, 1.0, 1.0], TypeError, "head_mask must be an mxnet.numpy.ndarray; got list"),
    "numpy": (np.ones(4), TypeError, "head_mask must be an mxnet.numpy.ndarray; got ndarray"),
    "legacy": (mx.nd.ones(4), TypeError, r"\(use .as_np_ndarray\(\)\)"),
    "int": (mx.np.ones(4, dtype=np.int32), TypeError, "head_mask must be a floating-point"),
    "bool": (mx.np.ones(4, dtype=np.bool_), TypeError, "head_mask must be a floating-point"),
    "heads": (mx.np.ones(5), ValueError, r"head_mask must have shape .*; got \(5,\)"),
    "batch": (mx.np.ones((2, 4)), ValueError, r"head_mask must have shape .*; got \(2, 4\)"),
    "rank": (mx.np.ones((3, 4, 1)), ValueError, "head_mask must have shape"),
    "scalar": (mx.np.ones(()), ValueError, r"head_mask must have shape .*; got \(\)"),
    "device": (mx.np.ones(4, ctx=mx.cpu(1)), ValueError, r"head_mask is on cpu\(1\)"),
}


@pytest.mark.parametrize("name", list(BAD_MASKS))
def test_bad_masks_are_named(name):
    mask, error, match = BAD_MASKS[name]
    weights, inputs = weights_and_inputs("mha")
    layer = layer_of(IMPERATIVE, "mha", weights)
    with pytest.raises(error, match=match):
        layer(*natives(inputs), native(LENS), head_mask=mask)
    rows = natives({key: x[:, :2] for key, x in inputs.items()})
    with pytest.raises(error, match=match):
        layer(*rows, cache=layer.init_cache(3, 4), head_mask=mask)


def test_no_keys_gate_a_zero_context():
    # K = 0: the context is zero, so the output is b_o whatever the gates,
    # and their gradient is zero (not what an earlier call left), as the
    # reference's.
    weights, inputs = weights_and_inputs("mha", num_keys=0)
    layer = layer_of(IMPERATIVE, "mha", weights)
    output_gradient = np.ones((3, 4, NUM_HIDDENS))
    grads = backend.vjp(
        layer,
        *natives(inputs),
        None,
        causal=False,
        output_gradient=native(output_gradient),
        head_mask=native(GATES[2]),
    )
    expected = spec.reference_gradients(
        weights,
        *inputs.values(),
        num_heads=NUM_HEADS,
        head_mask=GATES[2],
        output_gradient=output_gradient,
    )
    np.testing.assert_array_equal(backend.to_numpy(grads["head_mask"]), expected["head_mask"])
    output = layer(*natives(inputs), head_mask=native(GATES[1]))
    assert_close(output, np.broadcast_to(weights["b_o"], (3, 4, NUM_HIDDENS)))


@RUNNERS
@pytest.mark.parametrize("kind", KINDS)
def test_head_importance_is_the_references(runner, kind):
    # Dropout is in the layer, and out of the importance (eval mode).
    rng = np.random.default_rng(6)
    weights, first = weights_and_inputs(kind, seed=6)
    _, second = weights_and_inputs(kind, seed=7, batch=2, num_queries=3, num_keys=5)
    batches = [
        (first, LENS, rng.standard_normal((3, 4, NUM_HIDDENS))),
        (second, rng.integers(0, 6, size=(2, 3)), rng.standard_normal((2, 3, NUM_HIDDENS))),
    ]
    layer = layer_of(runner, kind, weights, dropout=0.3)
    ones = np.ones(NUM_HEADS)
    expected = [
        spec.reference_gradients(
            weights,
            *inputs.values(),
            lens,
            **reference_heads(kind),
            head_mask=ones,
            output_gradient=output_gradient,
        )["head_mask"]
        for inputs, lens, output_gradient in batches
    ]
    gradient = iter([native(g) for _, _, g in batches] * 2)

    def loss_fn(output):
        return (output * next(gradient)).sum()

    native_batches = [(*natives(inputs), native(lens)) for inputs, lens, _ in batches]
    for normalize in (True, False):
        scores = head_importance(layer, iter(native_batches), loss_fn, normalize=normalize)
        assert scores.dtype == np.float64 and scores.shape == (NUM_HEADS,)
        np.testing.assert_allclose(
            scores, heads.importance(expected, normalize=normalize), rtol=0, atol=GRAD_ATOL
        )
    # Only the gates' gradient was taken: the parameters' stay zero.
    assert not layer.W_q.weight.grad().asnumpy().any()


@RUNNERS
@pytest.mark.parametrize(
    ("kind", "pruned"),
    [("mha", [1, 3]), ("mha", [0, 1, 2]), ("gqa", [0, 1])],
    ids=["two-heads", "to-one-head", "a-group"],
)
def test_a_pruned_layer_is_the_layer_with_those_heads_off(runner, kind, pruned):
    weights, inputs = weights_and_inputs(kind)
    smaller, config = heads.prune_heads(
        weights, pruned, num_heads=NUM_HEADS, num_kv_heads=KV_HEADS[kind]
    )
    layer = set_weights(MultiHeadAttention(**config.kwargs()), smaller)
    if runner is HYBRID:
        layer.hybridize()
    full = layer_of(runner, kind, weights)
    gates = np.ones(NUM_HEADS)
    gates[pruned] = 0.0
    kept = [h for h in range(NUM_HEADS) if h not in pruned]
    expected = reference(weights, inputs, kind, causal=True, head_mask=gates)
    for return_attention_weights in (False, True):
        options = {"causal": True, "return_attention_weights": return_attention_weights}
        result = layer(*natives(inputs), native(LENS), **options)
        gated = full(*natives(inputs), native(LENS), head_mask=native(gates), **options)
        if return_attention_weights:
            (result, weights_out), (gated, gated_weights) = result, gated
            assert_close(weights_out, backend.to_numpy(gated_weights)[:, kept])
            assert_close(weights_out, expected[1][:, kept])
        assert_close(result, backend.to_numpy(gated))
        assert_close(result, expected[0])
