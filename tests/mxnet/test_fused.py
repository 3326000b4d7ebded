"""The MXNet layer's fast route: taken by default, the spec's numbers on every mask."""

from __future__ import annotations

import json

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from mha_multi import spec
from mha_multi.mxnet import MultiHeadAttention, set_weights
from mha_multi.mxnet._ops import MXNetOps
from mha_multi.parity.cases import CASES, build_case
from mha_multi.weights import KERNEL_NAMES

INPUT_NAMES = ("queries", "keys", "values")
#: Cases with rows that see no key (lengths <= 0, causal with Q > K) or
#: per-query masks: where a fast kernel would most likely depart from the spec.
HIDDEN_ROW_CASES = ("lens_zero", "lens_2d", "causal_more_queries", "causal_lens_2d", "one_key")


def case_named(name):
    return build_case(next(c for c in CASES if c.name == name))


def layer_for(case, *, hybridize=False, dtype="float32", **kwargs):
    config = case.config
    layer = MultiHeadAttention(
        config.num_hiddens, config.num_heads, bias=config.bias, dtype=dtype, **kwargs
    )
    set_weights(layer, case.weights)
    if hybridize:
        layer.hybridize()
    return layer


def arrays(case, dtype="float32"):
    return [mx.np.array(case.inputs[n], dtype=dtype) for n in INPUT_NAMES]


def lens(case):
    if case.valid_lens is None:
        return None
    return mx.np.array(case.valid_lens, dtype=case.valid_lens.dtype)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Names of the fast route's kernels, recorded whenever Python calls them.

    A hybridized layer calls them while tracing its graph (its first call
    per configuration); an imperative one on every call.
    """
    calls = []
    for module in (mx.ndarray.numpy_extension, mx.symbol.numpy_extension):
        for name in ("batch_dot", "sequence_mask"):
            original = getattr(module, name)

            def recording(*args, _original=original, _name=name, **kwargs):
                calls.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, recording)
    return calls


@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize(
    ("name", "masked"),
    [("lens_none", False), ("lens_1d", True), ("lens_zero", True), ("causal", True)],
)
def test_default_call_takes_the_fast_route(kernel_calls, hybridize, name, masked):
    case = case_named(name)
    layer = layer_for(case, hybridize=hybridize)
    out = layer(*arrays(case), lens(case), causal=case.config.causal)
    assert kernel_calls.count("batch_dot") == 2
    assert kernel_calls.count("sequence_mask") == int(masked)
    np.testing.assert_allclose(out.asnumpy(), case.reference["output"], rtol=0, atol=5e-6)
    kernel_calls.clear()
    output, weights = layer(
        *arrays(case), lens(case), causal=case.config.causal, return_attention_weights=True
    )
    assert kernel_calls == []  # the weights come from spec.attention
    np.testing.assert_allclose(output.asnumpy(), case.reference["output"], rtol=0, atol=5e-6)
    np.testing.assert_allclose(
        weights.asnumpy(), case.reference["attention_weights"], rtol=0, atol=5e-6
    )


def test_exported_default_graph_masks_without_where(tmp_path):
    case = case_named("causal_lens_2d")
    layer = layer_for(case, hybridize=True)
    ops = {}
    for return_attention_weights in (False, True):
        layer(
            *arrays(case),
            lens(case),
            causal=True,
            return_attention_weights=return_attention_weights,
        )
        prefix = str(tmp_path / f"mha{int(return_attention_weights)}")
        layer.export(prefix)
        with open(f"{prefix}-symbol.json") as file:
            nodes = json.load(file)["nodes"]
        ops[return_attention_weights] = {node["op"] for node in nodes}
    assert {"SequenceMask", "batch_dot"} <= ops[False]
    assert "_npi_where" not in ops[False]
    assert "_npi_where" in ops[True] and "SequenceMask" not in ops[True]


def _forward_and_gradients(layer, case, dtype="float32"):
    inputs = arrays(case, dtype)
    for array in inputs:
        array.attach_grad()
    with autograd.record(train_mode=False):
        output = layer(*inputs, lens(case), causal=case.config.causal)
    output.backward(mx.np.array(case.output_gradient, dtype=dtype))
    grads = {n: a.grad.asnumpy() for n, a in zip(INPUT_NAMES, inputs, strict=True)}
    for name in KERNEL_NAMES:
        dense = getattr(layer, name)
        grads[name] = dense.weight.grad().asnumpy().T
        if dense.bias is not None:
            grads[f"b_{name[-1]}"] = dense.bias.grad().asnumpy()
    return output.asnumpy(), grads


@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("name", HIDDEN_ROW_CASES)
def test_fast_route_matches_reference_with_fully_hidden_rows(name, hybridize):
    case = case_named(name)
    output, grads = _forward_and_gradients(layer_for(case, hybridize=hybridize), case)
    np.testing.assert_allclose(output, case.reference["output"], rtol=0, atol=5e-6)
    for key, grad in grads.items():
        np.testing.assert_allclose(
            grad, case.reference[f"grad.{key}"], rtol=0, atol=5e-5, err_msg=key
        )


@pytest.mark.parametrize("hybridize", [False, True])
def test_fully_hidden_rows_are_the_mean_of_the_values(hybridize):
    # Hand-computed expectation: a row that sees no key has uniform weights,
    # so its output is W_o applied to the mean of the projected values.
    case = case_named("lens_zero")  # lengths [0, -2, 3]
    layer = layer_for(case, hybridize=hybridize, dtype="float64")
    out = layer(*arrays(case, "float64"), lens(case)).asnumpy()
    values = case.inputs["values"].astype(np.float64)
    w = {k: v.astype(np.float64) for k, v in case.weights.items()}
    for b in (0, 1):
        expected = (values[b] @ w["W_v"]).mean(axis=0) @ w["W_o"]
        np.testing.assert_allclose(out[b], np.broadcast_to(expected, out[b].shape), atol=1e-12)


@pytest.mark.parametrize(
    ("dtype", "atol", "grad_atol"), [("float64", 1e-12, 1e-12), ("float16", 2e-2, 2e-2)]
)
@pytest.mark.parametrize("name", ["lens_zero", "causal_more_queries"])
def test_fast_route_other_dtypes(name, dtype, atol, grad_atol):
    case = case_named(name)
    layer = layer_for(case, hybridize=True, dtype=dtype)
    output, grads = _forward_and_gradients(layer, case, dtype)
    assert output.dtype == np.dtype(dtype)
    np.testing.assert_allclose(output, case.reference["output"], rtol=0, atol=atol)
    for key in INPUT_NAMES:
        np.testing.assert_allclose(
            grads[key], case.reference[f"grad.{key}"], rtol=0, atol=grad_atol, err_msg=key
        )


@pytest.mark.parametrize("name", ["book", "lens_1d_float", "causal_cross", "cross_sizes"])
def test_fast_and_generic_routes_agree(name):
    case = case_named(name)
    layer = layer_for(case, hybridize=True)
    kwargs = {"causal": case.config.causal}
    fast = layer(*arrays(case), lens(case), **kwargs).asnumpy()
    generic, _ = layer(*arrays(case), lens(case), return_attention_weights=True, **kwargs)
    np.testing.assert_allclose(fast, generic.asnumpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("hybridize", [False, True])
def test_fast_route_dropout_reaches_fully_hidden_rows(hybridize):
    # SequenceMask gives a fully hidden row the spec's uniform weights
    # *before* dropout, so dropout acts there too: the row is the mean of
    # the kept values scaled by 1/(1-p), not the plain mean.
    case = case_named("lens_zero")
    layer = layer_for(case, hybridize=hybridize, dropout=0.5)
    inputs = arrays(case)
    with autograd.record():
        dropped = layer(*inputs, lens(case)).asnumpy()
    np.testing.assert_allclose(
        layer(*inputs, lens(case)).asnumpy(), case.reference["output"], rtol=0, atol=5e-6
    )
    assert not np.allclose(dropped[:2], case.reference["output"][:2], atol=1e-3)


def test_adapter_fixes_fully_hidden_rows_like_numpy():
    # The adapter's fused-path operations (any_last, logical_not, mean and an
    # array fill in where) against the float64 reference adapter.
    rng = np.random.default_rng(0)
    output = rng.standard_normal((2, 3, 4, 5))
    values = rng.standard_normal((2, 3, 6, 5))
    valid_lens = np.array([[0, 2, 6, -1], [1, 0, 3, 9]])
    numpy_ops = spec.NumpyOps()
    scores = np.zeros((2, 3, 4, 6))
    visible = spec.visibility(numpy_ops, 4, 6, valid_lens, causal=True)
    expected = spec.fix_fully_hidden_rows(numpy_ops, output, values, visible, heads_axis=1)
    ops = MXNetOps(mx.nd)
    scores = mx.np.array(scores)
    got_visible = spec.visibility(
        ops, ops.size(scores, 2), ops.size(scores, 3), mx.np.array(valid_lens), causal=True
    )
    got = spec.fix_fully_hidden_rows(
        ops, mx.np.array(output), mx.np.array(values), got_visible, heads_axis=1
    )
    np.testing.assert_allclose(got.asnumpy(), expected, rtol=0, atol=1e-15)
