"""Packed sequences in the spec: the mask rule, restarting positions, converters, the reference.

Tiny cases computed by hand (one head of width 1, every weight 1: each score
is a product of two inputs), the converters on lengths written out, and the
reference's gradients against finite differences.
"""

from __future__ import annotations

import numpy as np
import pytest
from finite_differences import assert_central_differences

from mha_multi import spec
from mha_multi.weights import init_weights

OPS = spec.NumpyOps()
IDS = np.array([[0, 0, 1, 1, 1, -1], [5, 5, 5, 5, 2, 2]])


def test_visibility_sees_its_own_sequence_and_padding_nothing():
    visible = spec.segment_visibility(OPS, IDS, IDS)
    assert visible.shape == (2, 1, 6, 6)
    expected_row0 = np.zeros((6, 6), dtype=bool)
    expected_row0[:2, :2] = True
    expected_row0[2:5, 2:5] = True  # the padding row and column stay hidden
    np.testing.assert_array_equal(visible[0, 0], expected_row0)
    expected_row1 = np.zeros((6, 6), dtype=bool)
    expected_row1[:4, :4] = True
    expected_row1[4:, 4:] = True
    np.testing.assert_array_equal(visible[1, 0], expected_row1)


def test_positions_restart_at_each_sequence():
    np.testing.assert_array_equal(
        spec.segment_positions(OPS, IDS), [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]
    )
    np.testing.assert_array_equal(
        spec.restarting_positions(IDS), [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]
    )


def test_converters():
    ids = spec.segment_ids_from_lengths([[2, 3], [4, 2]], length=6)
    np.testing.assert_array_equal(ids, [[0, 0, 1, 1, 1, -1], [0, 0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(spec.cu_seqlens_from_segment_ids(ids), [0, 2, 5, 9, 11])
    np.testing.assert_array_equal(spec.cu_seqlens_from_segment_ids(IDS), [0, 2, 5, 9, 11])
    np.testing.assert_array_equal(
        spec.segment_ids_from_cu_seqlens([0, 2, 5], length=7), [[0, 0, 1, 1, 1, -1, -1]]
    )
    position_ids = np.array([[0, 1, 2, 0, 1, 0]])
    np.testing.assert_array_equal(
        spec.segment_ids_from_position_ids(position_ids), [[0, 0, 0, 1, 1, 2]]
    )
    np.testing.assert_array_equal(
        spec.restarting_positions(spec.segment_ids_from_position_ids(position_ids)), position_ids
    )
    # transformers' rule: a jump starts a sequence, wherever it lands.
    np.testing.assert_array_equal(
        spec.segment_ids_from_position_ids([[3, 4, 0, 1, 5]]), [[0, 0, 1, 1, 2]]
    )


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: spec.cu_seqlens_from_segment_ids([[0, 1, 0]]), ValueError, "contiguous"),
        (lambda: spec.segment_runs([[0.0, 1.0]]), TypeError, "segment_ids"),
        (lambda: spec.segment_ids_from_position_ids([[0.0, 1.0]]), TypeError, "position_ids"),
        (lambda: spec.segment_ids_from_cu_seqlens([1, 2]), ValueError, "cu_seqlens"),
        (lambda: spec.segment_ids_from_lengths([[3, 4]], length=5), ValueError, "more than"),
    ],
)
def test_converters_refuse(call, error, match):
    with pytest.raises(error, match=match):
        call()


def unit_weights():
    return {name: np.ones((1, 1)) for name in ("W_q", "W_k", "W_v", "W_o")}


def test_reference_by_hand():
    x = np.array([[[0.5], [-1.0], [2.0], [0.25]]])
    ids = np.array([[3, 3, 7, -1]])
    out, weights = spec.reference_forward(
        unit_weights(), x, x, x, num_heads=1, causal=True, segment_ids=ids
    )
    v = x[0, :, 0]

    def softmax_mean(i, keys):
        scores = np.array([v[i] * v[j] for j in keys])
        w = np.exp(scores - scores.max())
        return (w / w.sum()) @ v[keys]

    expected = [v[0], softmax_mean(1, [0, 1]), v[2], v.mean()]  # padding: the mean of all
    np.testing.assert_allclose(out[0, :, 0], expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(weights[0, 0, 3], np.full(4, 0.25), rtol=0, atol=0)


def test_reference_packed_row_is_each_sequence_alone_with_rotary():
    rng = np.random.default_rng(0)
    weights = init_weights(8, num_heads=2, seed=1, dtype=np.float64)
    lengths = [3, 2]
    x = rng.standard_normal((1, 6, 8))
    ids = spec.segment_ids_from_lengths([lengths], length=6)
    options = {"rotary": {"theta": 100.0}, "alibi": True, "window": 2}
    packed, _ = spec.reference_forward(
        weights, x, x, x, num_heads=2, causal=True, segment_ids=ids, **options
    )
    start = 0
    for length in lengths:
        alone = x[:, start : start + length]
        out, _ = spec.reference_forward(
            weights, alone, alone, alone, num_heads=2, causal=True, **options
        )
        np.testing.assert_allclose(packed[:, start : start + length], out, rtol=0, atol=1e-12)
        start += length


def test_reference_gradients_with_segments():
    rng = np.random.default_rng(2)
    weights = init_weights(4, num_heads=2, seed=3, dtype=np.float64)
    arrays = {
        "queries": rng.standard_normal((1, 4, 4)),
        "keys": rng.standard_normal((1, 5, 4)),
        "values": rng.standard_normal((1, 5, 4)),
    }
    ids = (np.array([[0, 0, 1, -1]]), np.array([[0, 1, 1, 1, -1]]))
    grad_out = rng.standard_normal((1, 4, 4))
    settings = {"num_heads": 2, "segment_ids": ids, "rotary": {"theta": 10.0}}

    def loss():
        out, _ = spec.reference_forward(weights, *arrays.values(), **settings)
        return float((out * grad_out).sum())

    grads = spec.reference_gradients(
        weights, *arrays.values(), output_gradient=grad_out, **settings
    )
    assert_central_differences(
        {name: grads[name] for name in arrays}, arrays, loss, rng=rng, entries=6
    )


@pytest.mark.parametrize(
    ("segment_ids", "error", "match"),
    [
        (np.zeros((1, 3), dtype=np.float32), TypeError, "segment_ids must be integers"),
        (np.zeros((1, 3), dtype=bool), TypeError, "segment_ids must be integers"),
        (np.zeros((1, 2), dtype=np.int32), ValueError, r"segment_ids of the queries"),
        ((np.zeros((1, 3), np.int32), np.zeros((1, 2), np.int32)), ValueError, "of the keys"),
    ],
)
def test_reference_refuses_bad_ids(segment_ids, error, match):
    x = np.zeros((1, 3, 1))
    with pytest.raises(error, match=match):
        spec.reference_forward(unit_weights(), x, x, x, num_heads=1, segment_ids=segment_ids)
