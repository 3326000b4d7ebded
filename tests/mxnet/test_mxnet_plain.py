"""The imperative layer's plans of plain self-attention: made once per signature, reused.

A call whose queries are its keys and values, and that asks for nothing
else, of an imperative layer recording nothing runs the plan of its
signature (docs: "Fast paths"): a second call reuses it, with the float64
reference's numbers and the generic flow's to the bit; another signature
makes its own; a decoding step still reads its lengths at every call.
"""

from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from mha_multi import spec
from mha_multi.mxnet import KVCache, MultiHeadAttention, set_weights
from mha_multi.mxnet._plain import plans_of
from mha_multi.weights import init_weights

HEADS = {"num_heads": 4, "num_kv_heads": 2}
ROTARY = {"theta": 100.0}
ATOL = 5e-6


def layer_and_weights(seed, rotary=None):
    weights = init_weights(16, seed=seed, bias=True, **HEADS)
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, rotary=rotary)
    return set_weights(layer, weights), weights


def native(x):
    return mx.np.array(x, dtype=np.float32)


@pytest.mark.parametrize("rotary", [None, ROTARY], ids=["plain", "rotary"])
def test_a_second_call_reuses_its_plan_and_another_signature_makes_its_own(rotary):
    layer, weights = layer_and_weights(3, rotary)
    x = np.random.default_rng(3).standard_normal((2, 5, 16))
    options = {} if rotary is None else {"rotary": rotary}

    def call(length, causal):
        rows = native(x[:, :length])
        got = layer(rows, rows, rows, causal=causal).asnumpy()
        expected, _ = spec.reference_forward(
            weights, *[x[:, :length]] * 3, **HEADS, causal=causal, **options
        )
        np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
        # Keys and values of their own take the generic flow: the same operations.
        generic = layer(rows, rows.copy(), rows.copy(), causal=causal).asnumpy()
        np.testing.assert_array_equal(got, generic)
        return got

    first = call(5, causal=True)
    (plan,) = plans_of(layer).values()
    assert plan is not None and plan.mask_lengths is not None  # causal over 5 positions
    np.testing.assert_array_equal(call(5, causal=True), first)
    assert [id(p) for p in plans_of(layer).values()] == [id(plan)]
    call(1, causal=True)
    call(5, causal=False)
    plans = list(plans_of(layer).values())
    assert len(plans) == 3 and plans[0] is plan and None not in plans


def test_decoding_steps_run_their_plan_and_still_read_the_lengths():
    layer, weights = layer_and_weights(4, ROTARY)
    x = np.random.default_rng(4).standard_normal((2, 6, 16))
    cache = layer.init_cache(2, 6)
    expected_cache = spec.KVCache(np.zeros((2, 2, 6, 4)), np.zeros((2, 2, 6, 4)), np.zeros(2))
    for start, stop in ((0, 2), (2, 3), (3, 4), (4, 5)):
        rows = native(x[:, start:stop])
        output, written = layer(rows, rows, rows, causal=True, cache=cache)
        assert written.keys is cache.keys and written.values is cache.values  # in place
        expected, _, expected_cache = spec.reference_cached_forward(
            weights, *[x[:, start:stop]] * 3, expected_cache, **HEADS, causal=True, rotary=ROTARY
        )
        np.testing.assert_allclose(output.asnumpy(), expected, rtol=0, atol=ATOL)
        cache = written
    steps = [p for p in plans_of(layer).values() if p is not None and p.max_length == 6]
    assert len(steps) == 1  # the prompt's causal chunk takes the generic flow; the steps one plan
    assert cache.lengths.asnumpy().tolist() == [5, 5]

    # Lengths of the same signature are read again: a full cache is refused,
    # nothing written; ragged lengths take the generic flow, with the reference's numbers.
    rows = native(x[:, 5:6])
    before = [array.asnumpy() for array in cache]
    full = KVCache(cache.keys, cache.values, mx.np.array([6, 5], dtype=np.int32))
    with pytest.raises(ValueError, match="overflows"):
        layer(rows, rows, rows, causal=True, cache=full)
    np.testing.assert_array_equal(cache.keys.asnumpy(), before[0])
    ragged = KVCache(cache.keys, cache.values, mx.np.array([5, 3], dtype=np.int32))
    held = spec.KVCache(before[0], before[1], np.array([5, 3]))
    output, _ = layer(rows, rows, rows, causal=True, cache=ragged)
    expected, _, _ = spec.reference_cached_forward(
        weights, *[x[:, 5:6]] * 3, held, **HEADS, causal=True, rotary=ROTARY
    )
    np.testing.assert_allclose(output.asnumpy(), expected, rtol=0, atol=ATOL)


def test_hybridized_recorded_and_dropping_calls_keep_no_plan():
    layer, weights = layer_and_weights(5)
    rows = native(np.random.default_rng(5).standard_normal((1, 3, 16)))
    with autograd.record():
        layer(rows, rows, rows)
    dropping = set_weights(MultiHeadAttention(16, 4, 0.5, num_kv_heads=2, bias=True), weights)
    with autograd.train_mode():  # npx.dropout acts: the generic flow's own
        dropping(rows, rows, rows)
    assert plans_of(dropping) == {}
    dropping(rows, rows, rows)  # in inference mode dropout does nothing: the plan
    assert len(plans_of(dropping)) == 1
    layer.hybridize()
    output = layer(rows, rows, rows)
    assert plans_of(layer) == {}
    expected, _ = spec.reference_forward(weights, *[rows.asnumpy()] * 3, **HEADS)
    np.testing.assert_allclose(output.asnumpy(), expected, rtol=0, atol=ATOL)
