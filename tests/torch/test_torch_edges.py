"""Edge inputs for the PyTorch layer beyond tests/backends/test_edges.py, eager and compiled.

Non-finite projections, empty axes, narrow integer lengths and dropout over
rows that lengths may hide take the generic path where SDPA would differ from
the spec; compiled graphs cannot branch on values, so theirs must be exact
for any. The numbers are the float64 reference's, its non-finite pattern
included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_support import assert_same_nonfinite_pattern
from torch_support import compiler as compiler
from torch_support import runner as runner

from mha_multi import spec
from mha_multi.parity.cases import INPUT_NAMES
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights


def edge_layer():
    weights = init_weights(8, bias=True, seed=4)
    return weights, set_weights(MultiHeadAttention(8, 2, bias=True), weights).eval()


def edge_inputs(num_queries=3, num_keys=5, batch=2):
    rng = np.random.default_rng(4)
    return [rng.standard_normal((batch, n, 8)) for n in (num_queries, num_keys, num_keys)]


# A non-finite key that lengths hide is tests/backends/test_fused_path.py's.
@pytest.mark.parametrize("where", ["query", "W_q"])
def test_nonfinite_projections_take_the_generic_path(runner, where):
    """Without lengths SDPA's CPU kernel returned zeros for a NaN query row."""
    weights, layer = edge_layer()
    queries, keys, values = edge_inputs()
    if where == "query":
        queries[0, 1, 2] = np.nan
    else:
        weights = {**weights, "W_q": weights["W_q"].copy()}
        weights["W_q"][3, 0] = np.inf
        set_weights(layer, weights)
    expected, _ = spec.reference_forward(weights, queries, keys, values, num_heads=2)
    with backend.kernel_spy() as calls:
        out = runner.call(layer, queries, keys, values)
    assert calls == []
    assert_same_nonfinite_pattern(out, expected)


@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 0, 4), (2, 3, 0)])
def test_empty_axes_take_the_generic_path(runner, shape):
    batch, num_queries, num_keys = shape
    weights, layer = edge_layer()
    inputs = edge_inputs(num_queries, num_keys, batch)
    expected, _ = spec.reference_forward(weights, *inputs, np.ones(batch), num_heads=2)
    with backend.kernel_spy() as calls:
        out = runner.call(layer, *inputs, np.ones(batch, np.float32))
    assert calls == []
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=0, atol=5e-6)


@pytest.mark.parametrize(
    "valid_lens",
    [
        np.array([100, 250], np.uint8),
        torch.tensor([100, -3], dtype=torch.int8),
        torch.tensor([2**63 + 5, 150], dtype=torch.uint64),
        np.array([2**63 + 5, 150], np.uint64),
        [2**63 + 5, 150],
    ],
    ids=["uint8", "int8", "uint64_tensor", "uint64_numpy", "list"],
)
def test_integer_lengths_are_compared_in_int64(runner, valid_lens):
    """Narrow lengths are widened before meeting key positions up to 199 (int8 wraps at 128)."""
    weights, layer = edge_layer()
    inputs = edge_inputs(2, 200)
    as_int64 = np.array(
        valid_lens.tolist() if hasattr(valid_lens, "tolist") else valid_lens, dtype=object
    )
    as_int64 = np.clip(as_int64, -1, 200).astype(np.int64)
    expected, expected_weights = spec.reference_forward(weights, *inputs, as_int64, num_heads=2)
    tensors = [runner.to_native(x) for x in inputs]
    out = runner.forward(layer, *tensors, valid_lens)
    generic, attention_weights = runner.forward(
        layer, *tensors, valid_lens, return_attention_weights=True
    )
    for got in (out, generic):
        np.testing.assert_allclose(runner.to_numpy(got), expected, rtol=0, atol=5e-6)
    np.testing.assert_allclose(
        runner.to_numpy(attention_weights), expected_weights, rtol=0, atol=5e-6
    )


def test_dropout_with_possibly_hidden_rows_takes_the_generic_path(runner, cases):
    case = cases["lens_zero"]
    config = case.config
    layer = runner.make_layer(config.num_hiddens, config.num_heads, dropout=0.5, **config.sizes())
    layer = runner.set_weights(layer, case.weights)
    inputs = [case.inputs[n] for n in INPUT_NAMES]
    with backend.kernel_spy() as calls:
        runner.call(layer, *inputs, case.valid_lens, training=True)
    assert calls == []
    with backend.kernel_spy() as calls:
        runner.call(layer, *inputs, training=True)
    assert len(calls) == 1 and calls[0].dropout == 0.5  # SDPA applies the dropout itself


# -- compiled ------------------------------------------------------------------


COMPILED_EDGES = {
    "nan_query": (lambda q, k, v: q.__setitem__((0, 1, 2), np.nan), None),
    "inf_in_hidden_key": (lambda q, k, v: k.__setitem__((0, 4, 1), np.inf), np.array([3, 5])),
    "nan_lengths": (lambda q, k, v: None, np.array([np.nan, 0.0])),
    "uint64_lengths": (lambda q, k, v: None, np.array([2**63 + 5, 2], np.uint64)),
}


@pytest.mark.parametrize("name", sorted(COMPILED_EDGES))
def test_torch_compile_edge_inputs_match_reference(runner, name, compiler):
    """Compiled graphs cannot branch on values; the path they take must be exact for any."""
    edit, valid_lens = COMPILED_EDGES[name]
    weights, layer = edge_layer()
    inputs = edge_inputs()
    edit(*inputs)
    reference_lens = None if valid_lens is None else np.clip(valid_lens, None, 5)
    compiled = compiler(layer, fullgraph=True)
    for causal in (False, True):
        expected, _ = spec.reference_forward(
            weights, *inputs, reference_lens, num_heads=2, causal=causal
        )
        out = runner.call(compiled, *inputs, valid_lens, causal=causal)
        assert_same_nonfinite_pattern(out, expected)


def test_torch_compile_empty_keys_and_gradients(runner, compiler):
    weights, layer = edge_layer()
    inputs = edge_inputs(num_keys=0)
    output_gradient = np.ones((2, 3, 8))
    expected = spec.reference_gradients(
        weights, *inputs, np.array([1, 2]), num_heads=2, output_gradient=output_gradient
    )
    compiled = compiler(layer, fullgraph=True)
    tensors = [runner.to_native(x).requires_grad_(True) for x in inputs]
    out = compiled(*tensors, torch.tensor([1, 2]))
    np.testing.assert_allclose(
        out.detach().numpy(), np.broadcast_to(weights["b_o"], (2, 3, 8)), rtol=0, atol=5e-6
    )
    out.backward(runner.to_native(output_gradient))
    np.testing.assert_allclose(layer.W_o.bias.grad.numpy(), expected["b_o"], atol=5e-5)
    np.testing.assert_allclose(tensors[0].grad.numpy(), expected["queries"], atol=5e-5)
    assert tensors[1].grad.shape == (2, 0, 8)
