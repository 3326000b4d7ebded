"""Every backend with packed sequences: the parity cases, the defining property, bad ids.

The packed cases against the float64 reference (float32 on the CPU here;
``nox -s parity`` runs every dtype), then the property that defines packing:
a row of several sequences gives, for each of them, what that sequence alone
gives (outputs and input gradients, causal, rotary, padding at the end); and
ids that are not integer ``(B, N)``, or a cache, refused naming
``segment_ids`` (docs: "Packed sequences").
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from parity_support import checks_within_tolerance

from mha_multi import spec
from mha_multi.parity.cases import build_case
from mha_multi.parity.compare import TOLERANCES
from mha_multi.parity.packed_cases import PACKED_CASES
from mha_multi.weights import init_weights

FORWARD, GRADIENTS = TOLERANCES["float32"]
#: Two sequences (alone: one call of two rows) and two positions of padding.
LENGTHS = [3, 3]
ROTARY = {"theta": 100.0}


@pytest.fixture(scope="module")
def packed_cases():
    return {config.name: build_case(config) for config in PACKED_CASES}


# One case here (ALiBi, a window, rotary, lengths); `nox -s parity` runs them all in every dtype.
@pytest.mark.parametrize("case_name", ["packed_alibi_window"])
def test_packed_case_within_tolerance(runner, packed_cases, case_name):
    case = packed_cases[case_name]
    checks = checks_within_tolerance(runner, "cpu", "float32", case)
    assert {c.quantity.split("[")[0] for c in checks} == set(case.reference)


def test_a_packed_row_is_each_sequence_alone(runner):
    rng = np.random.default_rng(11)
    weights = init_weights(8, num_heads=4, num_kv_heads=2, seed=12)
    layer = runner.set_weights(runner.make_layer(8, 4, num_kv_heads=2, rotary=ROTARY), weights)
    length = sum(LENGTHS) + 2
    x = [rng.standard_normal((1, length, 8)).astype(np.float32) for _ in range(3)]
    ids = spec.segment_ids_from_lengths([LENGTHS], length=length)
    real = ids[0] >= 0
    output_gradient = rng.standard_normal((1, length, 8)).astype(np.float32) * real[None, :, None]
    settings = {"causal": True, "device": "cpu", "dtype": "float32"}
    packed = runner.call(layer, *x, segment_ids=runner.native_lens(ids), **settings)
    grads = runner.gradients(
        layer, *x, None, output_gradient=output_gradient, segment_ids=ids, **settings
    )
    starts = np.cumsum([0, *LENGTHS[:-1]])
    for n in sorted(set(LENGTHS)):
        # The sequences of length n, alone, one a row.
        rows = [
            np.arange(start, start + n) for start, m in zip(starts, LENGTHS, strict=True) if m == n
        ]
        alone = [a[0, rows] for a in x]
        np.testing.assert_allclose(
            packed[0, rows], runner.call(layer, *alone, **settings), rtol=0, atol=FORWARD
        )
        grads_alone = runner.gradients(
            layer, *alone, None, output_gradient=output_gradient[0, rows], **settings
        )
        for name in ("queries", "keys", "values"):
            np.testing.assert_allclose(
                grads[name][0, rows], grads_alone[name], rtol=0, atol=GRADIENTS, err_msg=name
            )
    # Padding is seen by no query: its keys and values get no gradient.
    for name in ("keys", "values"):
        np.testing.assert_array_equal(grads[name][:, ~real], 0.0)


@pytest.mark.parametrize(
    "num_queries, query_ids, key_ids",
    [(4, [0, 1, 1, 1], [1, 1, 0, 0]), (3, [0, 1, 1], [1, 1, 1, 1, 0])],
    ids=["Q=K", "Q<K"],
)
def test_a_query_whose_keys_all_follow_it_sees_none(runner, num_queries, query_ids, key_ids):
    """Keys with ids of their own (a pair of ids) under the causal rule: query 0's keys
    of its id all lie after it, so it sees no key and takes the spec's uniform weights,
    with no gradient to the queries and keys (PyTorch's fused call gave it a zero
    context, and Keras on PyTorch wrong gradients)."""
    rng = np.random.default_rng(5)
    weights = init_weights(8, num_heads=2, seed=5, bias=True)
    layer = runner.set_weights(runner.make_layer(8, 2, bias=True), weights)
    num_keys = len(key_ids)
    q = rng.standard_normal((1, num_queries, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, num_keys, 8)).astype(np.float32) for _ in range(2))
    ids = (np.array([query_ids]), np.array([key_ids]))
    output_gradient = rng.standard_normal((1, num_queries, 8)).astype(np.float32)
    reference = {"num_heads": 2, "causal": True, "segment_ids": ids}
    expected, _ = spec.reference_forward(weights, q, k, v, **reference)
    expected_grads = spec.reference_gradients(
        weights, q, k, v, output_gradient=output_gradient, **reference
    )
    settings = {"causal": True, "device": "cpu", "dtype": "float32"}
    output = runner.call(layer, q, k, v, segment_ids=ids, **settings)
    np.testing.assert_allclose(output, expected, rtol=0, atol=FORWARD)
    grads = runner.gradients(
        layer, q, k, v, None, output_gradient=output_gradient, segment_ids=ids, **settings
    )
    for name in ("queries", "keys", "values"):
        np.testing.assert_allclose(
            grads[name], expected_grads[name], rtol=0, atol=GRADIENTS, err_msg=name
        )


def test_padding_longer_than_the_sequences_leaves_a_rotary_of_the_calls_length_alone(runner):
    """A rotary type of the call's length (dynamic NTK scaling past a context of 2) reads
    the longest sequence's, however long the padding after it (padding's positions are
    0): a sequence of 2 before 6 positions of padding gives what it gives alone."""
    rotary = {
        "theta": 100.0,
        "scaling": {"rope_type": "dynamic", "factor": 4.0, "max_position_embeddings": 2},
    }
    weights = init_weights(8, num_heads=2, seed=7)
    layer = runner.set_weights(runner.make_layer(8, 2, rotary=rotary), weights)
    x = np.random.default_rng(7).standard_normal((1, 8, 8)).astype(np.float32)
    ids = spec.segment_ids_from_lengths([[2]], length=8)  # [[0, 0, -1, ..., -1]]
    settings = {"causal": True, "device": "cpu", "dtype": "float32"}
    packed = runner.call(layer, x, x, x, segment_ids=ids, **settings)
    alone = runner.call(layer, *(x[:, :2],) * 3, **settings)
    np.testing.assert_allclose(packed[:, :2], alone, rtol=0, atol=FORWARD)
    expected, _ = spec.reference_forward(
        weights, x, x, x, num_heads=2, rotary=rotary, segment_ids=ids, causal=True
    )
    reference_alone, _ = spec.reference_forward(
        weights, *(x[:, :2],) * 3, num_heads=2, rotary=rotary, causal=True
    )
    np.testing.assert_allclose(expected[:, :2], reference_alone, rtol=0, atol=1e-12)
    np.testing.assert_allclose(packed, expected, rtol=0, atol=FORWARD)


@pytest.mark.parametrize(
    ("ids", "segments"),
    [
        (np.array([[2**32] * 3 + [0, 0, -(2**32) + 1]], np.int64), [[0, 0, 0, 1, 1, -1]]),
        (np.array([[2**64 - 1] * 3 + [5] * 3], np.uint64), [[0, 0, 0, 1, 1, 1]]),
        (np.array([[7, 7, 7, 3, 3, -1]], np.int16), [[0, 0, 0, 1, 1, -1]]),
    ],
    ids=["int64 beyond int32", "uint64 beyond int64", "int16"],
)
def test_ids_of_any_integer_dtype_on_the_host_mean_their_segments(runner, ids, segments):
    """Numpy ids of any integer dtype mean their segments: ids beyond int32 stay apart
    (JAX without x64 would wrap 2**32 onto 0, and -2**32 + 1 onto a real id), a uint64
    beyond int64 is an id (no unsigned id is padding), int16 ids (MXNet has no such
    arrays) are ids. The reference's outputs, which are those of the segments numbered
    from 0, rotary positions restarting at each."""
    weights = init_weights(8, num_heads=2, seed=3)
    layer = runner.set_weights(runner.make_layer(8, 2, rotary=ROTARY), weights)
    x = np.random.default_rng(3).standard_normal((1, 6, 8)).astype(np.float32)
    settings = {"num_heads": 2, "rotary": ROTARY, "causal": True}
    expected, _ = spec.reference_forward(weights, x, x, x, segment_ids=ids, **settings)
    numbered, _ = spec.reference_forward(
        weights, x, x, x, segment_ids=np.array(segments), **settings
    )
    np.testing.assert_allclose(expected, numbered, rtol=0, atol=1e-12)
    got = runner.call(layer, x, x, x, segment_ids=ids, causal=True, device="cpu", dtype="float32")
    np.testing.assert_allclose(got, expected, rtol=0, atol=FORWARD)


def test_a_pair_of_one_array_gives_the_queries_and_keys_its_ids(runner):
    """``segment_ids=(ids, ids)``, one array given for the queries and for the keys, is a
    pair like any other: the ids of self-attention (MXNet stacked the pair into one
    ``(2, B, N)`` array and refused it)."""
    weights = init_weights(8, num_heads=2, seed=3)
    layer = runner.set_weights(runner.make_layer(8, 2), weights)
    x = np.random.default_rng(4).standard_normal((2, 6, 8)).astype(np.float32)
    ids = np.array([[0, 0, 1, 1, 1, -1], [4, 4, 4, 4, 2, 2]], np.int32)
    expected, _ = spec.reference_forward(weights, x, x, x, segment_ids=ids, num_heads=2)
    got = runner.call(layer, x, x, x, segment_ids=(ids, ids), device="cpu", dtype="float32")
    np.testing.assert_allclose(got, expected, rtol=0, atol=FORWARD)


@pytest.mark.parametrize(
    ("segment_ids", "error", "match"),
    [
        (np.zeros((2, 4), np.float32), TypeError, "segment_ids must be integers"),
        (np.zeros((2, 3), np.int32), ValueError, "segment_ids of the queries"),
    ],
)
def test_bad_ids_are_named(runner, segment_ids, error, match):
    layer = runner.set_weights(runner.make_layer(8, 2), init_weights(8, num_heads=2))
    x = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(error, match=match):
        runner.call(layer, x, x, x, segment_ids=runner.native_lens(segment_ids))


_GOOD_IDS = np.array([[0, 0, 1, 1], [0, 1, 1, -1]], np.int32)


@pytest.mark.parametrize(
    ("segment_ids", "match"),
    [
        (np.array([[0, 0, 1, None], [0, 1, 1, 1]], object), "got dtype kind 'O' for the queries"),
        ([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, -1.0]], "got dtype kind 'f' for the queries"),
        ((_GOOD_IDS, _GOOD_IDS.astype(bool)), "got dtype kind 'b' for the keys"),
    ],
    ids=["object", "float list", "bool keys"],
)
def test_ids_on_the_host_that_are_no_integers_are_named(runner, segment_ids, match):
    """Numpy arrays and lists, as given: refused before any framework converts them
    (Keras' conversion refused object arrays in words of its own)."""
    layer = runner.set_weights(runner.make_layer(8, 2), init_weights(8, num_heads=2))
    x = runner.to_native(np.zeros((2, 4, 8), np.float32))
    with pytest.raises(TypeError, match="segment_ids must be integers .*" + re.escape(match)):
        runner.call_as_given(layer, x, x, x, segment_ids=segment_ids)


def test_a_cached_call_refuses_ids(runner):
    layer = runner.set_weights(runner.make_layer(8, 2), init_weights(8, num_heads=2))
    x = runner.to_native(np.zeros((1, 2, 8), np.float32))
    cache = runner.init_cache(layer, 1, 4)
    ids = runner.native_lens(np.zeros((1, 2), np.int32))
    with pytest.raises(ValueError, match="segment_ids are not supported with a cache"):
        runner.forward(layer, x, x, x, None, causal=True, cache=cache, segment_ids=ids)


#: The backends whose default call runs a fused kernel on the CPU in float32.
FUSED_ON_CPU = ("torch", "keras-torch")


def test_the_fused_kernel_takes_the_mask(runner):
    layer = runner.set_weights(runner.make_layer(8, 2), init_weights(8, num_heads=2))
    x = np.random.default_rng(13).standard_normal((1, 6, 8)).astype(np.float32)
    ids = spec.segment_ids_from_lengths([[2, 3]], length=6)
    with runner.kernel_spy() as calls:
        output = runner.call(layer, x, x, x, causal=True, segment_ids=runner.native_lens(ids))
    # SDPA (PyTorch's, and Keras' on PyTorch) takes the packed sequences' mask.
    assert [call.mask for call in calls] == ([True] if runner.name in FUSED_ON_CPU else [])
    weights = init_weights(8, num_heads=2)
    expected, _ = spec.reference_forward(
        weights, x, x, x, num_heads=2, causal=True, segment_ids=ids
    )
    # The padding row is fully hidden: the mean of all values, as the spec has it.
    np.testing.assert_allclose(output, expected, rtol=0, atol=FORWARD)
