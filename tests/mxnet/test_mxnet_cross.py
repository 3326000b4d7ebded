"""The imperative layer's plans of plain cross-attention: made once per signature, reused.

d2l's ``attention(X, Y, Y, valid_lens)`` (keys and values of the call's own,
nothing else asked) of an imperative layer without options runs the plan of
its signature (docs: "Fast paths"), with the float64 reference's numbers and
the generic flow's to the bit, gradients included; what the plan does not
take (a causal call, a hybridized layer, a layer with options) takes the
generic flow.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from mha_multi import spec
from mha_multi.mxnet import MultiHeadAttention, _facts, set_weights
from mha_multi.mxnet._cross import plans_of
from mha_multi.weights import init_weights

ATOL = 5e-6
#: Lengths of a batch of 3: none, one per example (integer and float, 0 hiding every
#: key), one per query (5 queries).
LENGTHS = {
    "none": None,
    "int": np.array([1, 7, 0], dtype=np.int32),
    "float": np.array([2.0, 7.0, 3.0], dtype=np.float32),
    "per query": np.array([[0, 1, 2, 7, 7], [3, 3, 3, 3, 3], [7, 6, 5, 4, 0]], dtype=np.float32),
}


def layer_and_weights(seed, **options):
    weights = init_weights(16, seed=seed, bias=True, num_heads=4, num_kv_heads=2)
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, **options)
    return set_weights(layer, weights), weights


def generic_only():
    """No plan answering: every call takes the generic flow."""
    return mock.patch.object(_facts.MXNetFacts, "cross_attention", lambda *_, **__: None)


def recorded(layer, queries, keys, values, lens):
    """The output and the gradients of the inputs and every parameter, recorded."""
    inputs = [queries, keys] if keys is values else [queries, keys, values]
    for x in inputs:
        x.attach_grad()
    with autograd.record():
        output = layer(queries, keys, values, lens)
    output.backward()
    grads = [x.grad.asnumpy() for x in inputs]
    grads += [p.grad().asnumpy() for p in layer.collect_params().values()]
    return [output.asnumpy(), *grads]


@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("shared", [True, False], ids=["keys are values", "values apart"])
def test_a_cross_call_runs_its_plan_to_the_reference_and_the_generic_flows_bits(lengths, shared):
    layer, weights = layer_and_weights(5)
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((3, 5, 16)), rng.standard_normal((3, 7, 16))
    z = y if shared else rng.standard_normal((3, 7, 16))
    lens = LENGTHS[lengths]
    queries, keys = mx.np.array(x, dtype=np.float32), mx.np.array(y, dtype=np.float32)
    values = keys if shared else mx.np.array(z, dtype=np.float32)
    native_lens = None if lens is None else mx.np.array(lens)
    got = layer(queries, keys, values, native_lens).asnumpy()
    (plan,) = plans_of(layer).values()
    assert plan is not None
    expected, _ = spec.reference_forward(weights, x, y, z, lens, num_heads=4, num_kv_heads=2)
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    # Recorded, the plan's output and gradients are the generic flow's.
    planned = recorded(layer, queries, keys, values, native_lens)
    assert [id(p) for p in plans_of(layer).values()] == [id(plan)]
    with generic_only():
        generic = recorded(layer, queries, keys, values, native_lens)
    for a, b in zip(planned, generic, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(planned[0], got)


def test_another_signature_makes_its_own_plan_and_errors_are_the_generic_flows():
    layer, weights = layer_and_weights(6)
    rng = np.random.default_rng(6)
    for num_keys in (7, 2, 7):
        x, y = rng.standard_normal((2, 3, 16)), rng.standard_normal((2, num_keys, 16))
        keys = mx.np.array(y, dtype=np.float32)
        got = layer(mx.np.array(x, dtype=np.float32), keys, keys)
        expected, _ = spec.reference_forward(weights, x, y, y, num_heads=4, num_kv_heads=2)
        np.testing.assert_allclose(got.asnumpy(), expected, rtol=0, atol=ATOL)
    assert len(plans_of(layer)) == 2
    queries = mx.np.zeros((2, 3, 16))
    wrong = (mx.np.zeros((2, 7, 16)), mx.np.zeros((2, 6, 16)))  # keys and values apart
    errors = []
    for answering in (contextlib.nullcontext(), generic_only()):
        with answering, pytest.raises(ValueError) as raised:
            layer(queries, *wrong)
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


def test_causal_hybridized_and_optioned_calls_keep_no_plan():
    rng = np.random.default_rng(7)
    x = mx.np.array(rng.standard_normal((2, 3, 16)), dtype=np.float32)
    y = mx.np.array(rng.standard_normal((2, 4, 16)), dtype=np.float32)
    layer, weights = layer_and_weights(7)
    layer(x, y, y, causal=True)
    assert not plans_of(layer)
    rotary, _ = layer_and_weights(7, rotary={"theta": 100.0})
    rotary(x, y, y)
    assert not plans_of(rotary)
    hybrid, _ = layer_and_weights(7)
    hybrid.hybridize()
    got = hybrid(x, y, y).asnumpy()
    assert not plans_of(hybrid)
    expected, _ = spec.reference_forward(
        weights, x.asnumpy(), y.asnumpy(), y.asnumpy(), num_heads=4, num_kv_heads=2
    )
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
