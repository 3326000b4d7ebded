"""The spec against independent implementations: loops, hand-computed cases, finite differences."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from finite_differences import assert_central_differences
from kernel_plans import MASK_ONLY, SDPA_LIKE, XLA_LIKE, assert_fused, assert_generic
from test_spec_positions import naive_forward

from mha_multi import spec
from mha_multi.parity.cases import CASES, build_case
from mha_multi.weights import init_weights

OPS = spec.NumpyOps()


@pytest.mark.parametrize("config", CASES, ids=lambda c: c.name)
def test_reference_matches_naive_loops(config):
    case = build_case(config)
    weights = {k: v.astype(np.float64) for k, v in case.weights.items()}
    inputs = [case.inputs[n].astype(np.float64) for n in ("queries", "keys", "values")]
    lens = None if case.valid_lens is None else case.valid_lens.tolist()
    # Every option and the gates written out, one key at a time.
    expected_out, expected_attention = naive_forward(
        weights,
        *inputs,
        lens,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        causal=config.causal,
        positions=case.positions,
        bias=None if case.bias is None else case.bias.astype(np.float64),
        gates=config.head_mask,
        **config.layer_options(),
    )
    np.testing.assert_allclose(case.reference["output"], expected_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        case.reference["attention_weights"], expected_attention, rtol=0, atol=1e-12
    )


def test_transpose_qkv_layout():
    batch, length, num_heads, head_dim = 2, 3, 4, 5
    x = np.arange(batch * length * num_heads * head_dim).reshape(batch, length, -1)
    heads = spec.transpose_qkv(OPS, x, num_heads)
    assert heads.shape == (batch * num_heads, length, head_dim)
    for b in range(batch):
        for h in range(num_heads):
            np.testing.assert_array_equal(
                heads[b * num_heads + h], x[b, :, h * head_dim : (h + 1) * head_dim]
            )
    np.testing.assert_array_equal(spec.transpose_output(OPS, heads, num_heads), x)


def tiny_weights(num_hiddens):
    eye = np.eye(num_hiddens)
    return {"W_q": eye, "W_k": eye, "W_v": eye, "W_o": eye}


def test_hand_computed_single_head():
    # q = [1, 0]; keys [1, 0] and [0, 1]: scores 1/sqrt(2) and 0.
    queries = np.array([[[1.0, 0.0]]])
    keys = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    values = np.array([[[2.0, 0.0], [0.0, 4.0]]])
    e = math.exp(1 / math.sqrt(2))
    expected_weights = np.array([e, 1.0]) / (e + 1.0)
    out, attention = spec.reference_forward(tiny_weights(2), queries, keys, values, num_heads=1)
    np.testing.assert_allclose(attention[0, 0, 0], expected_weights, rtol=1e-15)
    np.testing.assert_allclose(out[0, 0], [2 * expected_weights[0], 4 * expected_weights[1]])


def test_hand_computed_masks():
    queries = np.zeros((2, 2, 2))  # equal scores: weights are uniform over visible keys
    keys = np.zeros((2, 3, 2))
    values = np.array([[[3.0, 0], [6, 0], [9, 0]]] * 2)
    w = tiny_weights(2)
    _, a = spec.reference_forward(w, queries, keys, values, np.array([2, 0]), num_heads=1)
    np.testing.assert_allclose(a[0, 0], [[0.5, 0.5, 0], [0.5, 0.5, 0]])
    np.testing.assert_allclose(a[1, 0], np.full((2, 3), 1 / 3))  # fully hidden: uniform
    out, a = spec.reference_forward(w, queries, keys, values, num_heads=1, causal=True)
    # Q=2, K=3: query 0 sees keys 0..1, query 1 sees keys 0..2 (bottom-right).
    np.testing.assert_allclose(a[0, 0], [[0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]])
    np.testing.assert_allclose(out[0, :, 0], [4.5, 6.0])
    lens_2d = np.array([[1, 5], [3, -1]])
    _, a = spec.reference_forward(w, queries, keys, values, lens_2d, num_heads=1, causal=True)
    np.testing.assert_allclose(a[0, 0], [[1, 0, 0], [1 / 3, 1 / 3, 1 / 3]])
    np.testing.assert_allclose(a[1, 0], [[0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]])


def test_float_lengths_are_compared_not_rounded():
    visible = spec.visibility(OPS, 1, 4, np.array([2.5, 0.5], np.float32))
    np.testing.assert_array_equal(visible[:, 0, 0], [[1, 1, 1, 0], [1, 0, 0, 0]])


def test_sixteen_bit_lengths_are_compared_in_float32():
    # float16 holds 2050 exactly but not every position below it (2049).
    visible = spec.visibility(OPS, 1, 2100, np.array([2050], np.float16))
    assert visible.sum() == 2050


def test_valid_lens_repeat_interleaved_across_heads():
    # Two examples with different lengths, three heads: every head of example
    # b must use valid_lens[b] (interleaved), never valid_lens[h % B] (tiled).
    rng = np.random.default_rng(0)
    weights = init_weights(6, seed=1, dtype=np.float64)
    x = rng.standard_normal((2, 1, 6))
    kv = rng.standard_normal((2, 4, 6))
    _, attention = spec.reference_forward(weights, x, kv, kv, np.array([1, 3]), num_heads=3)
    assert np.all(attention[0, :, :, 1:] == 0) and np.all(attention[0, :, :, 0] == 1)
    assert np.all(attention[1, :, :, 3] == 0) and np.all(attention[1, :, :, :3] > 0)


def test_masked_softmax_sixteen_bit_is_computed_in_float32():
    scores = np.zeros((1, 1, 1, 3), np.float16)
    visible = np.zeros((1, 1, 1, 3), bool)  # fully hidden: -1e6 overflows float16
    weights = spec.masked_softmax(OPS, scores, visible)
    assert weights.dtype == np.float16
    np.testing.assert_array_equal(weights, np.full((1, 1, 1, 3), np.float16(1 / 3)))


def test_check_inputs_messages():
    with pytest.raises(ValueError, match="queries must be 3-D"):
        spec.check_inputs((2, 3), (2, 3, 4), (2, 3, 4))
    with pytest.raises(ValueError, match="keys batch size 3 differs from queries batch size 2"):
        spec.check_inputs((2, 3, 4), (3, 3, 4), (3, 3, 4))
    with pytest.raises(ValueError, match="same length; got 3 keys and 4 values"):
        spec.check_inputs((2, 3, 4), (2, 3, 4), (2, 4, 4))
    with pytest.raises(ValueError, match="values last dimension must be value_size=5"):
        spec.check_inputs((2, 3, 4), (2, 3, 4), (2, 3, 4), value_size=5)
    with pytest.raises(ValueError, match=r"valid_lens must have shape \(batch,\) = \(2,\)"):
        spec.check_inputs((2, 3, 4), (2, 5, 4), (2, 5, 4), (2, 5))
    spec.check_inputs((2, 3, 4), (2, 5, 4), (2, 5, 4), (2, 3))


@pytest.mark.parametrize(
    ("num_hiddens", "num_heads", "dropout", "error", "match"),
    [
        (10, 3, 0.0, ValueError, r"num_hiddens \(10\) must be divisible by num_heads \(3\)"),
        (0, 1, 0.0, ValueError, "num_hiddens must be a positive int"),
        (8, -2, 0.0, ValueError, "num_heads must be a positive int"),
        (8.0, 2, 0.0, TypeError, "num_hiddens must be a positive int"),
        (8, 2, 1.0, ValueError, r"dropout must be in \[0, 1\)"),
        (8, 2, -0.1, ValueError, r"dropout must be in \[0, 1\)"),
        (8, 2, "0.1", TypeError, "dropout must be a float"),
    ],
)
def test_check_config(num_hiddens, num_heads, dropout, error, match):
    with pytest.raises(error, match=match):
        spec.check_config(num_hiddens, num_heads, dropout)


@pytest.mark.parametrize("config", CASES, ids=lambda c: c.name)
def test_reference_gradients_match_finite_differences(config):
    case = build_case(config)
    weights = {k: v.astype(np.float64) for k, v in case.weights.items()}
    inputs = {k: v.astype(np.float64) for k, v in case.inputs.items()}
    if case.bias is not None:
        inputs["bias"] = case.bias.astype(np.float64)
    cotangent = case.output_gradient.astype(np.float64)
    kwargs = {
        "num_heads": config.num_heads,
        "causal": config.causal,
        "positions": case.positions,
        **config.layer_options(),
    }
    args = [inputs[name] for name in ("queries", "keys", "values")]

    def loss():
        out, _ = spec.reference_forward(
            weights, *args, case.valid_lens, bias=inputs.get("bias"), **kwargs
        )
        return float(np.sum(out * cotangent))

    grads = spec.reference_gradients(
        weights,
        *args,
        case.valid_lens,
        output_gradient=cotangent,
        bias=inputs.get("bias"),
        **kwargs,
    )
    assert set(grads) == {*inputs, *weights}
    # Central differences on a few random entries of every array.
    arrays = {**inputs, **weights}
    assert_central_differences(grads, arrays, loss, rng=np.random.default_rng(0), entries=6)


def test_fix_fully_hidden_rows_gives_the_spec_result():
    # A fused kernel's output for lengths [0, 2]: zeros where every key is hidden.
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, 4, 5)) for _ in range(3))  # (B, H, T, dh)
    lens = np.array([0, 2])
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(5)
    visible = spec.visibility(OPS, 4, 4, lens)
    masked = np.where(visible, scores, -np.inf)
    with np.errstate(invalid="ignore"):
        weights = np.exp(masked - masked.max(-1, keepdims=True))
        fused = np.nan_to_num(weights / weights.sum(-1, keepdims=True)) @ v
    expected = spec.masked_softmax(OPS, scores, visible) @ v
    fixed = spec.fix_fully_hidden_rows(OPS, fused, v, visible, heads_axis=1)
    np.testing.assert_allclose(fixed, expected, atol=1e-12)
    heads_last = spec.fix_fully_hidden_rows(
        OPS, fused.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), visible, heads_axis=2
    )
    np.testing.assert_allclose(heads_last, expected.transpose(0, 2, 1, 3), atol=1e-12)
    causal = spec.visibility(OPS, 4, 2, None, causal=True)  # Q=4 > K=2
    fused_causal = np.zeros((1, 1, 4, 5))
    fixed = spec.fix_fully_hidden_rows(OPS, fused_causal, v[:1, :1, :2], causal, heads_axis=1)
    np.testing.assert_allclose(fixed[0, 0, :2], np.broadcast_to(v[0, 0, :2].mean(0), (2, 5)))
    np.testing.assert_array_equal(fixed[0, 0, 2:], 0.0)


def _edge_inputs():
    rng = np.random.default_rng(11)
    queries, keys, values = (rng.standard_normal((2, n, 6)) for n in (3, 4, 4))
    lens = np.array([2, 4])

    def edited(array, index, value):
        array = array.copy()
        array[index] = value
        return array

    return {
        "nan_query": (edited(queries, (0, 1, 2), np.nan), keys, values, lens),
        "inf_hidden_key": (queries, edited(keys, (0, 3, 0), np.inf), values, lens),
        "nan_hidden_value": (queries, keys, edited(values, (0, 3, 0), np.nan), lens),
        "inf_visible_key": (queries, edited(keys, (1, 0, 0), np.inf), values, lens),
        "nan_lengths": (queries, keys, values, np.array([np.nan, 3.0])),
        "huge_lengths": (queries, keys, values, np.array([2**62, -(2**62)])),
        "no_keys": (queries, keys[:, :0], values[:, :0], lens),
        "no_queries": (queries[:, :0], keys, values, np.ones((2, 0))),
        "no_batch": (queries[:0], keys[:0], values[:0], lens[:0]),
    }


EDGE_INPUTS = _edge_inputs()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(EDGE_INPUTS))
def test_reference_edges_match_naive_loops(name, causal):
    """Non-finite inputs, NaN and huge lengths and empty axes, against one-at-a-time loops."""
    weights = init_weights(6, bias=True, seed=11)
    queries, keys, values, lens = EDGE_INPUTS[name]
    out, attention = spec.reference_forward(
        weights, queries, keys, values, lens, num_heads=3, causal=causal
    )
    expected_out, expected_attention = naive_forward(
        weights, queries, keys, values, lens, num_heads=3, causal=causal
    )
    for got, expected in ((out, expected_out), (attention, expected_attention)):
        assert got.shape == expected.shape
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=1e-12)


def test_no_keys_gives_the_output_bias_and_its_gradients():
    weights = init_weights(6, bias=True, seed=12)
    rng = np.random.default_rng(12)
    queries, keys = rng.standard_normal((2, 3, 6)), np.zeros((2, 0, 6))
    out, attention = spec.reference_forward(weights, queries, keys, keys, num_heads=3)
    assert attention.shape == (2, 3, 3, 0)
    np.testing.assert_array_equal(out, np.broadcast_to(weights["b_o"], (2, 3, 6)))
    grad_out = rng.standard_normal(out.shape)
    grads = spec.reference_gradients(
        weights, queries, keys, keys, num_heads=3, output_gradient=grad_out
    )
    np.testing.assert_allclose(grads["b_o"], grad_out.sum(axis=(0, 1)), atol=1e-12)
    for name in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "queries"):
        np.testing.assert_array_equal(grads[name], 0.0, err_msg=name)
    assert grads["keys"].shape == grads["values"].shape == (2, 0, 6)


def test_scores_of_sixteen_bit_heads_stay_float32():
    """Heads of 300 give scores near 1.8e5, past float16's largest number (65504)."""
    q = np.full((1, 2, 4), 300.0, np.float16)
    scores = spec.scaled_scores(OPS, q, q, head_dim=4)
    assert scores.dtype == np.float32
    np.testing.assert_array_equal(scores, np.full((1, 2, 2), 4 * 300.0**2 / 2, np.float32))


def test_attention_weights_take_the_dtype_of_the_values():
    q = np.full((2, 2, 4), 300.0, np.float16)
    context, weights = spec.attention(OPS, q, q, q, np.array([1, 2]), num_heads=2, head_dim=2)
    assert weights.dtype == context.dtype == np.float16
    assert np.all(np.isfinite(weights)) and np.all(np.isfinite(context))


@pytest.mark.parametrize("causal", ["False", 1, np.array(True), None])
def test_causal_must_be_a_bool(causal):
    weights = init_weights(6, seed=13)
    x = np.ones((1, 2, 6))
    with pytest.raises(TypeError, match="causal must be a bool"):
        spec.reference_forward(weights, x, x, x, num_heads=3, causal=causal)
    spec.reference_forward(weights, x, x, x, num_heads=3, causal=np.bool_(True))


def test_integer_lengths_are_clipped_not_wrapped():
    lens = np.array([2**62, -(2**62), 2**31, 7, -1], np.int64)
    np.testing.assert_array_equal(
        spec.clip_integer_lens(lens, np.int32), [2**31 - 1, -(2**31), 2**31 - 1, 7, -1]
    )
    assert spec.clip_integer_lens(lens, np.int32).dtype == np.int32
    unsigned = np.array([2**64 - 1, 3], np.uint64)
    np.testing.assert_array_equal(spec.clip_integer_lens(unsigned, np.int32), [2**31 - 1, 3])
    floats = np.array([np.nan, 2.5])
    assert spec.clip_integer_lens(floats, np.int32) is floats


def test_float64_lengths_narrowed_to_float32_show_the_keys_they_show():
    lens = np.array([5e-324, 2 + 1e-9, 2.0, 2.5, -1e-300, np.nan, np.inf, -np.inf])
    narrowed = spec.lens_as_numpy(lens, np.int32, np.float32)
    assert narrowed.dtype == np.float32
    # Key j is shown iff j < len: the keys 0..4 of each length, counted by hand.
    shown = [1, 3, 2, 3, 0, 0, 5, 0]
    np.testing.assert_array_equal((np.arange(5) < narrowed[:, None]).sum(1), shown)
    np.testing.assert_array_equal((np.arange(5) < lens[:, None]).sum(1), shown)
    float32 = np.array([1e-45, 2.5], np.float32)
    np.testing.assert_array_equal(spec.lens_as_numpy(float32, np.int32, np.float32), float32)
    assert spec.lens_as_numpy(lens, np.int64).dtype == np.float64  # (no narrower type)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16])
def test_narrow_integer_lengths_compare_without_wrapping(dtype):
    visible = spec.visibility(OPS, 1, 200, np.array([100, 127], dtype))
    np.testing.assert_array_equal(visible.sum(axis=-1).ravel(), [100, 127])


# -- the kernel plan ---------------------------------------------------------

# (kernel, facts, the fields that are true), each worked out from the rules on
# the "Fast paths" page.
PLANS = {
    "no lengths": (SDPA_LIKE, {}, set()),
    "causal, Q == K: the kernel's flag": (SDPA_LIKE, {"causal": True}, {"is_causal"}),
    "causal, Q < K: bottom-right needs the mask": (
        SDPA_LIKE,
        {"causal": True, "sizes": (2, 3, 5)},
        {"mask_causal"},
    ),
    "causal, Q > K: whole rows hidden": (
        SDPA_LIKE,
        {"causal": True, "sizes": (2, 5, 3)},
        {"mask_causal", "fix_rows", "fix_causal"},
    ),
    "lengths into the mask, rows may be hidden": (
        SDPA_LIKE,
        {"lens_ndim": 1},
        {"mask_lens", "fix_rows"},
    ),
    "lengths read as > 0 hide no row": (
        SDPA_LIKE,
        {"lens_ndim": 1, "shortest_length": 1.0},
        {"mask_lens"},
    ),
    "lengths read as >= K hide nothing": (
        SDPA_LIKE,
        {"lens_ndim": 2, "shortest_length": 4.0, "causal": True},
        {"is_causal"},
    ),
    "NaN lengths hide every key": (
        SDPA_LIKE,
        {"lens_ndim": 1, "shortest_length": float("nan")},
        {"mask_lens", "fix_rows"},
    ),
    "lengths with causal: no flag beside a mask": (
        SDPA_LIKE,
        {"lens_ndim": 1, "causal": True},
        {"mask_lens", "mask_causal", "fix_rows"},
    ),
    "integer lengths as key lengths, causal flag beside them": (
        XLA_LIKE,
        {"lens_ndim": 1, "causal": True},
        {"is_causal", "key_lengths", "fix_rows"},
    ),
    "float lengths into the mask": (
        XLA_LIKE,
        {"lens_ndim": 1, "lens_integer": False},
        {"mask_lens", "fix_rows"},
    ),
    "2-D lengths into the mask, with the flag": (
        XLA_LIKE,
        {"lens_ndim": 2, "causal": True},
        {"is_causal", "mask_lens", "fix_rows"},
    ),
    "no causal flag: the rule goes into the mask": (
        MASK_ONLY,
        {"lens_ndim": 1, "causal": True},
        {"mask_lens", "mask_causal"},
    ),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_kernel_plan(name):
    assert_fused(*PLANS[name])


GENERIC = {
    "weights requested": (SDPA_LIKE, {"return_attention_weights": True}),
    "dtype not served": (SDPA_LIKE, {"dtype_supported": False}),
    "empty batch": (SDPA_LIKE, {"sizes": (0, 4, 4)}),
    "no keys": (XLA_LIKE, {"sizes": (2, 4, 0)}),
    "sizes unknown": (XLA_LIKE, {"sizes": (2, None, 4)}),
    "values unreadable, added mask": (SDPA_LIKE, {"values_exact": None}),
    "values not finite, added mask": (SDPA_LIKE, {"values_exact": False}),
    "values not finite, a guard offered": (
        SDPA_LIKE,
        {"values_exact": False, "values_guard": True},
    ),
    "values unreadable, a guard with dropout": (
        SDPA_LIKE,
        {"values_exact": None, "values_guard": True, "dropout": True},
    ),
    "dropout, no dropout in the kernel": (XLA_LIKE, {"dropout": True}),
    "dropout, rows may be hidden": (SDPA_LIKE, {"dropout": True, "lens_ndim": 1}),
    "dropout, causal Q > K": (SDPA_LIKE, {"dropout": True, "causal": True, "sizes": (2, 5, 3)}),
}


@pytest.mark.parametrize("name", sorted(GENERIC))
def test_kernel_plan_generic(name):
    assert_generic(*GENERIC[name])


def test_kernel_plan_fused_where_values_do_not_matter():
    # A kernel that replaces hidden scores needs no read of the values;
    # dropout with lengths that may hide rows is exact where rows come out uniform.
    assert spec.plan_kernel(XLA_LIKE, sizes=(1, 2, 2), lens_ndim=None, values_exact=None).fused
    plan = spec.plan_kernel(MASK_ONLY, sizes=(1, 2, 2), lens_ndim=1, dropout=True)
    assert plan.fused and not plan.fix_rows


def test_kernel_plan_guards_unread_values_where_the_caller_can():
    # Values that cannot be read run the kernel under a guard on the device,
    # with the same plan otherwise; read values never need one.
    facts = {"sizes": (2, 4, 4), "lens_ndim": 1, "causal": True}
    guarded = spec.plan_kernel(SDPA_LIKE, **facts, values_exact=None, values_guard=True)
    read = spec.plan_kernel(SDPA_LIKE, **facts, values_exact=True, values_guard=True)
    assert guarded.fused and guarded.guarded and not read.guarded
    assert dataclasses.replace(guarded, guarded=False) == read
    replacing = spec.plan_kernel(XLA_LIKE, **facts, values_exact=None, values_guard=True)
    assert replacing.fused and not replacing.guarded


def test_a_call_on_an_accelerator_reads_its_values_only_where_its_scores_are_many():
    # On the host every eager call reads; on an accelerator only from 256 x 256
    # scores per head, whatever the shape that gives them.
    assert spec.DEVICE_READ_SCORES == 65536
    for num_queries, num_keys in ((1, 1), (1, 65535), (255, 256), (128, 511)):
        assert spec.reads_values(True, num_queries, num_keys)
        assert not spec.reads_values(False, num_queries, num_keys)
    for num_queries, num_keys in ((256, 256), (1, 65536), (128, 512), (4096, 4096)):
        assert spec.reads_values(False, num_queries, num_keys)


def test_a_call_recording_no_gradient_reads_only_where_its_scores_in_all_are_many():
    # Recording no gradient, from 2**26 scores in all as well: two examples of 2048
    # positions and 8 heads, not one example, nor four of 1024 positions.
    assert spec.DEVICE_READ_TOTAL_SCORES == 1 << 26
    for batch, length in ((2, 2048), (8, 2048), (1, 8192)):
        assert spec.reads_values(False, length, length, total_scores=batch * 8 * length**2)
    for batch, length in ((1, 2048), (4, 1024), (8, 512), (1 << 20, 255)):
        assert not spec.reads_values(False, length, length, total_scores=batch * 8 * length**2)
    assert spec.reads_values(True, 1, 1, total_scores=1)  # the host reads at every call


def test_kernel_plan_repeats_grouped_heads_only_for_kernels_without_groups():
    facts = {"sizes": (1, 2, 2), "lens_ndim": None, "values_exact": True, "grouped": True}
    assert spec.plan_kernel(SDPA_LIKE, **facts).repeat_kv
    grouping = spec.FusedKernel("grouping", takes_grouped_heads=True)
    assert not spec.plan_kernel(grouping, **facts).repeat_kv
    assert not spec.plan_kernel(SDPA_LIKE, **{**facts, "grouped": False}).repeat_kv
    # A kernel that takes groups, for a call whose framework serves them better repeated.
    assert spec.plan_kernel(grouping, **facts, grouped_taken=False).repeat_kv
    assert not spec.plan_kernel(
        grouping, **{**facts, "grouped": False}, grouped_taken=False
    ).repeat_kv


def test_kernel_plan_leaves_a_mask_its_kernel_takes_slowly_to_the_generic_path():
    """``mask_taken=False`` (the framework's kernel runs such a mask over these sizes
    slower than the generic path): a call that needs a mask or bias takes the generic
    path; one that needs none keeps the kernel."""
    kernel = spec.FusedKernel("takes masks and biases", takes_bias=True)
    facts = {"sizes": (2, 4, 4), "values_exact": True, "mask_taken": False}
    needing = {
        "lengths": {"lens_ndim": 1},
        "lengths that may hide a row": {"lens_ndim": 2, "shortest_length": 0},
        "the causal rule off the kernel's frame": {
            "lens_ndim": None,
            "causal": True,
            "sizes": (2, 4, 6),
        },
        "the causal rule beside lengths": {"lens_ndim": 1, "causal": True},
        "a window": {"lens_ndim": None, "window": True, "sizes": (2, 4, 6)},
        "a bias": {"lens_ndim": None, "bias": True},
        "packed sequences": {"lens_ndim": None, "segments": True},
    }
    for name, settings in needing.items():
        plan = spec.plan_kernel(kernel, **{**facts, **settings})
        assert not plan.fused, name
        assert "mask" in plan.reason, name
        assert spec.plan_kernel(kernel, **{**facts, **settings, "mask_taken": True}).fused, name
    needing_none = {
        "no lengths": {"lens_ndim": None},
        "lengths that hide nothing": {"lens_ndim": 1, "shortest_length": 4},
        "the kernel's causal flag": {"lens_ndim": None, "causal": True},
    }
    for name, settings in needing_none.items():
        assert spec.plan_kernel(kernel, **{**facts, **settings}).fused, name


def test_kernel_plan_masks_are_the_spec_visibility():
    lens = np.array([3, 0])
    plan = spec.plan_kernel(SDPA_LIKE, sizes=(2, 4, 3), lens_ndim=1, causal=True, values_exact=True)
    mask = plan.mask(OPS, 4, 3, lens)
    np.testing.assert_array_equal(mask, spec.visibility(OPS, 4, 3, lens, causal=True))
    fix = plan.fix_visibility(OPS, 4, 3, lens)
    np.testing.assert_array_equal(fix, mask)
    no_causal_rows = spec.plan_kernel(
        SDPA_LIKE, sizes=(2, 3, 4), lens_ndim=1, causal=True, values_exact=True
    )
    np.testing.assert_array_equal(
        no_causal_rows.fix_visibility(OPS, 3, 4, lens), spec.visibility(OPS, 3, 4, lens)
    )


# -- grouped-query attention and an explicit head size ------------------------


def _repeat_kv_columns(weights, num_kv_heads, group_size):
    """Multi-head weights whose key/value heads are the grouped ones repeated."""
    repeated = dict(weights)
    for name in ("W_k", "W_v", "b_k", "b_v"):
        if name in weights:
            w = weights[name]
            heads = w.reshape(*w.shape[:-1], num_kv_heads, -1)
            repeated[name] = np.repeat(heads, group_size, axis=-2).reshape(*w.shape[:-1], -1)
    return repeated


def _naive_attention(
    weights, queries, keys, values, valid_lens, *, num_heads, head_dim, group_size
):
    """A per-example, per-head loop: query head h reads key/value head h // group_size."""
    q = queries @ weights["W_q"]
    k = keys @ weights["W_k"]
    v = values @ weights["W_v"]
    batch, num_queries, _ = queries.shape
    context = np.zeros((batch, num_queries, num_heads * head_dim))
    for b in range(batch):
        for h in range(num_heads):
            j = h // group_size
            q_h = q[b, :, h * head_dim : (h + 1) * head_dim]
            k_h = k[b, :, j * head_dim : (j + 1) * head_dim]
            v_h = v[b, :, j * head_dim : (j + 1) * head_dim]
            scores = q_h @ k_h.T / np.sqrt(head_dim)
            scores[:, np.arange(keys.shape[1]) >= valid_lens[b]] = -1e6
            attn = np.exp(scores - scores.max(-1, keepdims=True))
            context[b, :, h * head_dim : (h + 1) * head_dim] = (
                attn / attn.sum(-1, keepdims=True) @ v_h
            )
    return context @ weights["W_o"]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 2, 3), (4, 1, 3), (6, 3, 2), (3, 3, 5), (2, 1, 7)],
)
def test_grouped_heads_match_a_per_head_loop(num_heads, num_kv_heads, head_dim):
    rng = np.random.default_rng(21)
    num_hiddens, batch = 10, 2
    weights = {
        "W_q": rng.standard_normal((5, num_heads * head_dim)),
        "W_k": rng.standard_normal((6, num_kv_heads * head_dim)),
        "W_v": rng.standard_normal((7, num_kv_heads * head_dim)),
        "W_o": rng.standard_normal((num_heads * head_dim, num_hiddens)),
    }
    queries = rng.standard_normal((batch, 3, 5))
    keys, values = rng.standard_normal((batch, 4, 6)), rng.standard_normal((batch, 4, 7))
    lens = np.array([2, 4])
    out, attn = spec.reference_forward(weights, queries, keys, values, lens, num_heads=num_heads)
    assert attn.shape == (batch, num_heads, 3, 4)
    expected = _naive_attention(
        weights,
        queries,
        keys,
        values,
        lens,
        num_heads=num_heads,
        head_dim=head_dim,
        group_size=num_heads // num_kv_heads,
    )
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_grouped_gradients_sum_the_repeated_heads(num_kv_heads, causal):
    # GQA is MHA on repeated key/value heads: its key/value weight gradients are
    # the repeated heads' gradients summed over each group.
    rng = np.random.default_rng(22)
    num_heads, head_dim, group = 4, 3, 4 // num_kv_heads
    weights = {
        "W_q": rng.standard_normal((5, num_heads * head_dim)),
        "W_k": rng.standard_normal((5, num_kv_heads * head_dim)),
        "W_v": rng.standard_normal((5, num_kv_heads * head_dim)),
        "W_o": rng.standard_normal((num_heads * head_dim, 8)),
        "b_q": rng.standard_normal(num_heads * head_dim),
        "b_k": rng.standard_normal(num_kv_heads * head_dim),
        "b_v": rng.standard_normal(num_kv_heads * head_dim),
        "b_o": rng.standard_normal(8),
    }
    queries, keys, values = (rng.standard_normal((2, 5, 5)) for _ in range(3))
    lens = np.array([[1, 3, 0, 5, 2], [4, 4, 4, 4, 4]])
    cotangent = rng.standard_normal((2, 5, 8))
    kwargs = {"num_heads": num_heads, "causal": causal, "output_gradient": cotangent}
    grads = spec.reference_gradients(weights, queries, keys, values, lens, **kwargs)
    repeated = _repeat_kv_columns(weights, num_kv_heads, group)
    expected = spec.reference_gradients(repeated, queries, keys, values, lens, **kwargs)
    for name in ("queries", "keys", "values", "W_q", "W_o", "b_q", "b_o"):
        np.testing.assert_allclose(grads[name], expected[name], rtol=0, atol=1e-10)
    for name in ("W_k", "W_v", "b_k", "b_v"):
        summed = expected[name].reshape(*expected[name].shape[:-1], num_kv_heads, group, head_dim)
        np.testing.assert_allclose(
            grads[name], summed.sum(axis=-2).reshape(grads[name].shape), rtol=0, atol=1e-10
        )
    out, _ = spec.reference_forward(
        weights, queries, keys, values, lens, num_heads=num_heads, causal=causal
    )
    out_repeated, _ = spec.reference_forward(
        repeated, queries, keys, values, lens, num_heads=num_heads, causal=causal
    )
    np.testing.assert_allclose(out, out_repeated, rtol=0, atol=1e-12)


def test_grouped_layout_round_trips():
    x = np.arange(2 * 3 * 12).reshape(2, 3, 12)  # B=2, Q=3, H=4 heads of 3
    grouped = spec.transpose_grouped_queries(OPS, x, 2, 2)
    assert grouped.shape == (4, 6, 3)
    # Row block b*H_kv + j holds heads j*G .. j*G + G - 1, one after the other.
    np.testing.assert_array_equal(grouped[1, 3:], x[0, :, 9:12])
    np.testing.assert_array_equal(spec.transpose_grouped_output(OPS, grouped, 2, 2), x)
    np.testing.assert_array_equal(
        spec.transpose_grouped_queries(OPS, x, 4, 1), spec.transpose_qkv(OPS, x, 4)
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_kv_heads": 3}, ValueError, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be a positive int"),
        ({"num_kv_heads": 2.0}, TypeError, "num_kv_heads must be a positive int"),
        ({"head_dim": 0}, ValueError, "head_dim must be a positive int"),
        ({"head_dim": "8"}, TypeError, "head_dim must be a positive int"),
    ],
)
def test_head_configuration_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        spec.check_heads(8, 4, **kwargs)


def test_explicit_head_dim_frees_num_hiddens_from_num_heads():
    with pytest.raises(ValueError, match="or head_dim must be given"):
        spec.check_heads(10, 4)
    heads = spec.check_heads(10, 4, num_kv_heads=2, head_dim=3)
    assert (heads.query_features, heads.kv_features, heads.group_size) == (12, 6, 2)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "num_shards", "local"),
    [(8, 8, 2, (4, 4)), (8, 2, 2, (4, 1)), (8, 4, 4, (2, 1)), (4, 1, 1, (4, 1))],
)
def test_shard_heads_splits_query_and_key_value_heads_alike(
    num_heads, num_kv_heads, num_shards, local
):
    heads = spec.Heads(num_heads, num_kv_heads, 3)
    shard = spec.shard_heads(heads, num_shards)
    assert (shard.num_heads, shard.num_kv_heads, shard.head_dim) == (*local, 3)
    assert shard.group_size == heads.group_size


@pytest.mark.parametrize(
    ("num_shards", "error", "match"),
    [
        (3, ValueError, r"number of shards \(3\) must divide num_heads \(8\)"),
        (4, ValueError, r"number of shards \(4\) must divide num_kv_heads \(2\)"),
        (0, ValueError, "num_shards must be a positive int"),
        (2.0, TypeError, "num_shards must be a positive int"),
    ],
)
def test_shard_heads_errors_name_the_counts(num_shards, error, match):
    with pytest.raises(error, match=match):
        spec.shard_heads(spec.Heads(8, 2, 4), num_shards)


@pytest.mark.parametrize(("num_kv_heads", "causal"), [(4, False), (2, True)])
def test_head_shards_sum_to_the_layer_after_w_o(num_kv_heads, causal):
    # The decomposition tensor parallelism relies on (docs: "Sharding heads"):
    # each shard's heads, through its rows of W_o, without b_o, summed over
    # shards, plus b_o once, is the whole layer.
    rng = np.random.default_rng(3)
    num_heads, head_dim, num_shards = 4, 3, 2
    sizes = {"W_q": (5, 12), "W_k": (6, 3 * num_kv_heads), "W_v": (7, 3 * num_kv_heads)}
    weights = {name: rng.standard_normal(shape) for name, shape in sizes.items()}
    weights["W_o"] = rng.standard_normal((12, 10))
    for name in ("q", "k", "v", "o"):
        weights[f"b_{name}"] = rng.standard_normal(weights[f"W_{name}"].shape[1])
    queries, keys, values = (rng.standard_normal((2, n, f)) for n, f in ((4, 5), (4, 6), (4, 7)))
    lens = np.array([2, 4])
    full, _ = spec.reference_forward(
        weights, queries, keys, values, lens, num_heads=num_heads, causal=causal
    )
    heads = spec.Heads(num_heads, num_kv_heads, head_dim)
    local = spec.shard_heads(heads, num_shards)
    total = weights["b_o"]
    for s in range(num_shards):
        q_cols = slice(s * local.query_features, (s + 1) * local.query_features)
        kv_cols = slice(s * local.kv_features, (s + 1) * local.kv_features)
        part = {
            "W_q": weights["W_q"][:, q_cols],
            "b_q": weights["b_q"][q_cols],
            "W_o": weights["W_o"][q_cols],
            "b_o": np.zeros(10),
        }
        for name in ("k", "v"):
            part[f"W_{name}"] = weights[f"W_{name}"][:, kv_cols]
            part[f"b_{name}"] = weights[f"b_{name}"][kv_cols]
        output, _ = spec.reference_forward(
            part, queries, keys, values, lens, num_heads=local.num_heads, causal=causal
        )
        total = total + output
    np.testing.assert_allclose(total, full, rtol=1e-12, atol=1e-12)


def loop_vmap(function, in_axes, out_axes):
    """``jax.vmap``'s meaning written as a loop (the test's independent map)."""

    def mapped(*args):
        size = next(
            a.shape[axis] for a, axis in zip(args, in_axes, strict=True) if axis is not None
        )
        results = [
            function(
                *(
                    a if axis is None else np.take(a, i, axis)
                    for a, axis in zip(args, in_axes, strict=True)
                )
            )
            for i in range(size)
        ]
        return tuple(
            np.stack([r[j] for r in results], axis=axis) for j, axis in enumerate(out_axes)
        )

    return mapped


@pytest.mark.parametrize("kv_split", [False, True])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "lens", "causal"),
    [(4, 4, None, False), (4, 2, [3, 0], True), (6, 1, [[1, 2, 3, 4], [4, 4, 0, 2]], False)],
)
def test_attention_by_kv_heads_is_attention(num_heads, num_kv_heads, lens, causal, kv_split):
    rng = np.random.default_rng(11)
    batch, num_queries, num_keys, dh = 2, 4, 5, 3
    q = rng.standard_normal((batch, num_queries, num_heads * dh))
    k, v = (rng.standard_normal((batch, num_keys, num_kv_heads * dh)) for _ in range(2))
    lens = None if lens is None else np.asarray(lens)
    options = {"num_heads": num_heads, "head_dim": dh, "num_kv_heads": num_kv_heads}
    expected = spec.attention(OPS, q, k, v, lens, causal=causal, **options)
    if kv_split:  # a cache's (B, H_kv, K, dh)
        k, v = (x.reshape(batch, num_keys, num_kv_heads, dh).transpose(0, 2, 1, 3) for x in (k, v))
    got = spec.attention_by_kv_heads(
        OPS, q, k, v, lens, causal=causal, kv_split=kv_split, vmap=loop_vmap, **options
    )
    for actual, wanted in zip(got, expected, strict=True):
        assert actual.shape == wanted.shape
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=1e-15)


@pytest.mark.parametrize("causal_only", [False, True])
def test_fix_fully_hidden_rows_of_grouped_heads_is_the_repeated_heads_fix(causal_only):
    # Query head h reads key/value head h // G: fixing with the grouped values
    # equals fixing with those values repeated per query head.
    rng = np.random.default_rng(7)
    batch, heads, kv_heads, num_queries, num_keys, dh = 2, 6, 2, 5, 3, 4
    group = heads // kv_heads
    lens = None if causal_only else np.array([0, 2])
    visible = spec.visibility(OPS, num_queries, num_keys, lens, causal=True)
    output = rng.standard_normal((batch, heads, num_queries, dh))
    values = rng.standard_normal((batch, kv_heads, num_keys, dh))
    repeated = np.repeat(values, group, axis=1)

    def fixed(values, layout, heads_axis, **grouping):
        moved = [array.transpose(layout) for array in (output, values)]
        return spec.fix_fully_hidden_rows(OPS, *moved, visible, heads_axis=heads_axis, **grouping)

    for heads_axis, layout in ((1, (0, 1, 2, 3)), (2, (0, 2, 1, 3))):
        got = fixed(values, layout, heads_axis, group_size=group)
        np.testing.assert_array_equal(got, fixed(repeated, layout, heads_axis))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (inf - inf)
@pytest.mark.parametrize("kv_split", [False, True])
def test_lengths_that_hide_no_key_change_no_bit(kv_split):
    """Lengths of at least ``K`` (or ``(B, Q)`` lengths each at least ``K``) give the
    numbers of no lengths to the bit, non-finite values included: the mask replaces
    no score (what a cached call's generic path counts on where the lengths read on
    the host hide no key it attends over: docs "Fast paths")."""
    ops = spec.NumpyOps()
    rng = np.random.default_rng(7)
    batch, num_queries, num_keys, num_heads, num_kv_heads, head_dim = 3, 2, 5, 4, 2, 3
    q = rng.standard_normal((batch, num_queries, num_heads * head_dim))
    if kv_split:
        k, v = (rng.standard_normal((batch, num_kv_heads, num_keys, head_dim)) for _ in "kv")
    else:
        k, v = (rng.standard_normal((batch, num_keys, num_kv_heads * head_dim)) for _ in "kv")
    q[0, 0, 0], k[1, ..., 1, 0], v[2, ..., 2, 1] = np.nan, np.inf, -np.inf
    settings = {"num_heads": num_heads, "head_dim": head_dim, "num_kv_heads": num_kv_heads}
    plain = spec.attention(ops, q, k, v, None, kv_split=kv_split, **settings)
    for lens in (np.array([5, 7, 5]), np.full((batch, num_queries), 5.5)):
        masked = spec.attention(ops, q, k, v, lens, kv_split=kv_split, **settings)
        for got, expected in zip(masked, plain, strict=True):
            np.testing.assert_array_equal(got.view(np.int64), expected.view(np.int64))
