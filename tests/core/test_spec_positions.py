"""Positions and biases in the spec: rotary, ALiBi, bias, windows, soft-capping.

Each option against loops written out here, one example, head, query and key
at a time, from the rules of docs "Positions and biases"; the hand-derived
gradients against finite differences; the cached form against one full call.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from finite_differences import assert_central_differences
from kernel_plans import SDPA_WITH_BIAS, SOFTCAPPED, UNIFORM, WINDOWED, assert_fused, assert_generic
from test_spec_cache import cached_attention

from mha_multi import spec
from mha_multi.parity.decode import decode, random_schedule
from mha_multi.weights import init_weights

OPS = spec.NumpyOps()

# -- independent formulas ------------------------------------------------------


def paper_slopes(num_heads):
    """The ALiBi paper's slopes (its reference code's recursion), for any head count."""

    def power_of_two(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(closest) + paper_slopes(2 * closest)[0::2][: num_heads - closest]


def loop_inverse_frequencies(head_dim, theta=10000.0, fraction=1.0, scaling=None):
    """Frequencies one at a time, Llama 3's scaling as Meta's ``apply_scaling`` loop."""
    rotated = int(head_dim * fraction)
    frequencies = []
    for i in range(rotated // 2):
        freq = 1.0 / math.pow(theta, 2 * i / rotated)
        if scaling is not None:
            old = scaling["original_max_position_embeddings"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            wavelength = 2 * math.pi / freq
            if wavelength > old / low:
                freq = freq / scaling["factor"]
            elif wavelength >= old / high:
                smooth = (old / wavelength - low) / (high - low)
                freq = (1 - smooth) * freq / scaling["factor"] + smooth * freq
        frequencies.append(freq)
    return frequencies


def loop_rotate(vector, position, frequencies, interleaved):
    """One head's vector rotated pair by pair; entries past the pairs unchanged."""
    out = np.array(vector, dtype=np.float64)
    half = len(frequencies)
    for p, freq in enumerate(frequencies):
        a, b = (2 * p, 2 * p + 1) if interleaved else (p, p + half)
        cos, sin = math.cos(position * freq), math.sin(position * freq)
        out[a] = vector[a] * cos - vector[b] * sin
        out[b] = vector[b] * cos + vector[a] * sin
    return out


def loop_norm(x, weight, norm, size):
    """A query/key norm written out, one group of ``size`` entries of one row at a time:
    ``g * x / sqrt(mean(x ** 2) + eps)``, ``g`` the weight or one plus it."""
    out = np.empty_like(x)
    gain = weight + 1.0 if norm.unit_offset else weight
    for b, t in np.ndindex(x.shape[:2]):
        for start in range(0, x.shape[2], size):
            group = x[b, t, start : start + size]
            rms = np.sqrt(sum(v * v for v in group) / size + norm.eps)
            out[b, t, start : start + size] = gain * group / rms
    return out


def naive_forward(
    weights,
    queries,
    keys,
    values,
    valid_lens=None,
    *,
    num_heads,
    num_kv_heads=None,
    causal=False,
    positions=None,
    bias=None,
    rotary=None,
    alibi=False,
    window=None,
    softcap=None,
    gates=None,
    qk_norm=None,
    sinks=False,
):
    """Every option written out: one example, head, query and key at a time.

    Query head ``h`` reads key/value head ``h // (num_heads // num_kv_heads)``;
    its context is multiplied by ``gates[h]`` (or ``gates[b][h]``) if given.
    With ``sinks``, head ``h``'s row is softmaxed with ``weights["sinks"][h]``
    as one more score, which is then dropped.
    """
    batch, num_queries, _ = queries.shape
    num_keys = keys.shape[1]
    head_dim = weights["W_q"].shape[1] // num_heads
    group = num_heads // (num_kv_heads or num_heads)

    def project(x, name):
        y = x @ weights[f"W_{name}"]
        return y + weights[f"b_{name}"] if f"b_{name}" in weights else y

    q, k, v = project(queries, "q"), project(keys, "k"), project(values, "v")
    if qk_norm is not None:
        norm = spec.QKNorm(**qk_norm)
        q = loop_norm(q, weights["q_norm"], norm, head_dim if norm.scope == "heads" else q.shape[2])
        k = loop_norm(k, weights["k_norm"], norm, head_dim if norm.scope == "heads" else k.shape[2])
    if rotary is not None:
        frequencies = loop_inverse_frequencies(
            head_dim,
            rotary.get("theta", 10000.0),
            rotary.get("fraction", 1.0),
            rotary.get("scaling"),
        )
        interleaved = rotary.get("interleaved", False)
        for b in range(batch):
            for t in range(num_queries):
                at = t if positions is None else positions[b % len(positions)][t]
                for h in range(num_heads):
                    cols = slice(h * head_dim, (h + 1) * head_dim)
                    q[b, t, cols] = loop_rotate(q[b, t, cols], at, frequencies, interleaved)
            for t in range(num_keys):
                at = t if positions is None else positions[b % len(positions)][t]
                for h in range(k.shape[2] // head_dim):
                    cols = slice(h * head_dim, (h + 1) * head_dim)
                    k[b, t, cols] = loop_rotate(k[b, t, cols], at, frequencies, interleaved)
    if bias is not None:
        bias = np.broadcast_to(bias, (batch, num_heads, num_queries, num_keys))
    slopes = paper_slopes(num_heads)
    context = np.zeros((batch, num_queries, num_heads * head_dim))
    attention = np.zeros((batch, num_heads, num_queries, num_keys))
    for b in range(batch):
        for h in range(num_heads):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            kv = h // group
            kv_cols = slice(kv * head_dim, (kv + 1) * head_dim)
            for i in range(num_queries):
                at = i + num_keys - num_queries  # bottom-right, as the causal rule
                scores = np.empty(num_keys)
                for j in range(num_keys):
                    score = sum(q[b, i, cols][d] * k[b, j, kv_cols][d] for d in range(head_dim))
                    score /= math.sqrt(head_dim)
                    if softcap is not None:
                        score = softcap * math.tanh(score / softcap)
                    if bias is not None:
                        score += bias[b, h, i, j]
                    if alibi:
                        score += slopes[h] * (j - at)
                    visible = True
                    if valid_lens is not None:
                        length = valid_lens[b] if np.ndim(valid_lens) == 1 else valid_lens[b][i]
                        visible = j < length
                    if causal and j > at:
                        visible = False
                    if window is not None and at - j >= window:
                        visible = False
                    scores[j] = score if visible else -1e6
                if num_keys == 0:
                    continue
                if sinks:
                    scores = np.append(scores, weights["sinks"][h])
                row = np.exp(scores - scores.max())
                row = (row / row.sum())[:num_keys]
                attention[b, h, i] = row
                context[b, i, cols] = row @ v[b, :, kv_cols]
                if gates is not None:
                    context[b, i, cols] *= gates[h] if np.ndim(gates) == 1 else gates[b][h]
    return project(context, "o"), attention


def setup(
    seed,
    *,
    batch=2,
    num_queries=5,
    num_keys=5,
    num_heads=4,
    num_kv_heads=None,
    head_dim=4,
    bias=False,
    scale=1.0,
):
    num_hiddens = num_heads * head_dim
    weights = init_weights(
        num_hiddens,
        bias=bias,
        seed=seed,
        query_size=6,
        key_size=5,
        value_size=3,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    weights = {name: w.astype(np.float64) for name, w in weights.items()}
    rng = np.random.default_rng(seed)
    inputs = {
        "queries": scale * rng.standard_normal((batch, num_queries, 6)),
        "keys": scale * rng.standard_normal((batch, num_keys, 5)),
        "values": rng.standard_normal((batch, num_keys, 3)),
    }
    return weights, inputs, rng


LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small enough for every branch at head_dim 8
}

# name -> (setup keywords, call keywords); arrays made in the test from the rng.
FORWARD = {
    "rotary half-split, causal": ({}, {"causal": True, "rotary": {}}),
    "rotary interleaved, grouped, own positions": (
        {"num_kv_heads": 2},
        {"rotary": {"interleaved": True, "theta": 100.0}, "positions": "ragged"},
    ),
    "partial rotary with Llama 3 scaling": (
        {"head_dim": 8, "num_heads": 2},
        {"rotary": {"fraction": 0.5, "scaling": LLAMA3}, "causal": True},
    ),
    "Llama 3 scaling, whole head": (
        {"head_dim": 8, "num_heads": 2},
        {"rotary": {"theta": 10.0, "scaling": LLAMA3}, "positions": "ragged"},
    ),
    "ALiBi, 3 heads, Q < K, causal": (
        {"num_heads": 3, "num_queries": 3, "num_keys": 6},
        {"alibi": True, "causal": True},
    ),
    "ALiBi, 12 heads, Q > K": (
        {"num_heads": 12, "num_queries": 4, "num_keys": 3, "head_dim": 2},
        {"alibi": True, "causal": True},
    ),
    "window, causal, lengths, Q < K": (
        {"num_queries": 4, "num_keys": 7},
        {"window": 3, "causal": True, "valid_lens": np.array([7, 4])},
    ),
    "window without causal, 2-D lengths": (
        {},
        {"window": 2, "valid_lens": np.array([[5, 1, 3, 0, 5], [2, 2, 5, 4, 1]])},
    ),
    "softcap": ({"scale": 4.0}, {"softcap": 2.0, "causal": True}),
    "bias (B, H, Q, K)": ({"bias": True}, {"bias": (2, 4, 5, 5)}),
    "bias (H, 1, K)": ({}, {"bias": (4, 1, 5), "valid_lens": np.array([3, 0])}),
    "bias (Q, K)": ({"num_queries": 3}, {"bias": (3, 5), "causal": True}),
    "bias (B, 1, 1, K)": ({}, {"bias": (2, 1, 1, 5)}),
    "bias ()": ({}, {"bias": ()}),
    "everything": (
        {"num_kv_heads": 2, "scale": 3.0, "bias": True},
        {
            "rotary": {"fraction": 0.5, "interleaved": True},
            "alibi": True,
            "window": 2,
            "softcap": 1.5,
            "causal": True,
            "valid_lens": np.array([4, 2]),
            "positions": "ragged",
            "bias": (2, 1, 5, 5),
        },
    ),
}


def call_arguments(kwargs, rng, batch, num_queries):
    kwargs = dict(kwargs)
    if kwargs.get("positions") == "ragged":
        # Left-padded rows: positions start below 0 and are uneven.
        kwargs["positions"] = np.arange(num_queries)[None] - np.array([[2], [0]])[:batch]
    if "bias" in kwargs:
        kwargs["bias"] = np.asarray(rng.standard_normal(kwargs["bias"]))
    return kwargs


@pytest.mark.parametrize("name", list(FORWARD))
def test_reference_forward_matches_loops(name):
    setup_kwargs, kwargs = FORWARD[name]
    weights, inputs, rng = setup(0, **setup_kwargs)
    num_heads = setup_kwargs.get("num_heads", 4)
    batch, num_queries = inputs["queries"].shape[:2]
    kwargs = call_arguments(kwargs, rng, batch, num_queries)
    valid_lens = kwargs.pop("valid_lens", None)
    heads = {"num_heads": num_heads, "num_kv_heads": setup_kwargs.get("num_kv_heads")}
    expected = naive_forward(weights, **inputs, valid_lens=valid_lens, **heads, **kwargs)
    got = spec.reference_forward(weights, *inputs.values(), valid_lens, **heads, **kwargs)
    for actual, wanted in zip(got, expected, strict=True):
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=1e-12)


def test_defaults_are_d2l_bit_for_bit():
    weights, inputs, _ = setup(1)
    lens = np.array([3, 5])
    plain = spec.reference_forward(weights, *inputs.values(), lens, num_heads=4, causal=True)
    explicit = spec.reference_forward(
        weights,
        *inputs.values(),
        lens,
        num_heads=4,
        causal=True,
        rotary=None,
        alibi=False,
        window=None,
        softcap=None,
        positions=None,
        bias=None,
    )
    wide_window = spec.reference_forward(
        weights, *inputs.values(), lens, num_heads=4, causal=True, window=10
    )
    for got in (explicit, wide_window):
        for a, b in zip(plain, got, strict=True):
            np.testing.assert_array_equal(a, b)


def test_rotation_by_position_zero_changes_nothing():
    weights, inputs, _ = setup(2, num_queries=1, num_keys=1)
    plain = spec.reference_forward(weights, *inputs.values(), num_heads=4)
    rotated = spec.reference_forward(weights, *inputs.values(), num_heads=4, rotary={})
    np.testing.assert_allclose(rotated[0], plain[0], rtol=0, atol=1e-15)


# -- rotary embeddings --------------------------------------------------------


@pytest.mark.parametrize(
    "rotary",
    [
        {},
        {"interleaved": True},
        {"fraction": 0.5},
        {"fraction": 0.75, "interleaved": True, "theta": 500000.0},
        {"scaling": LLAMA3},
    ],
    ids=["half-split", "interleaved", "partial", "partial interleaved", "llama3"],
)
@pytest.mark.parametrize("positions", ["(B, T)", "(1, T)", "(T,)"])
def test_rotate_matches_a_pair_loop(rotary, positions):
    rng = np.random.default_rng(3)
    batch, length, num_heads, head_dim = 2, 3, 2, 8
    x = rng.standard_normal((batch, length, num_heads * head_dim))
    at = {
        "(B, T)": rng.integers(-5, 3000, (batch, length)),
        "(1, T)": rng.integers(0, 100, (1, length)),
        "(T,)": np.arange(length),
    }[positions]
    got = spec.rotate(OPS, x, at, spec.check_rotary(rotary), num_heads, head_dim)
    frequencies = loop_inverse_frequencies(
        head_dim, rotary.get("theta", 10000.0), rotary.get("fraction", 1.0), rotary.get("scaling")
    )
    rows = np.broadcast_to(at, (batch, length))
    for b in range(batch):
        for t in range(length):
            for h in range(num_heads):
                cols = slice(h * head_dim, (h + 1) * head_dim)
                expected = loop_rotate(
                    x[b, t, cols], rows[b, t], frequencies, rotary.get("interleaved", False)
                )
                np.testing.assert_allclose(got[b, t, cols], expected, rtol=0, atol=1e-12)
    back = spec.rotate(OPS, got, at, spec.check_rotary(rotary), num_heads, head_dim, inverse=True)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-12)


def test_half_split_is_transformers_rotate_half_bit_for_bit():
    # transformers: q * cos + rotate_half(q) * sin, with cos = cat(c, c) in float32.
    rng = np.random.default_rng(4)
    head_dim = 8
    q = rng.standard_normal((2, 5, 3 * head_dim)).astype(np.float32)
    positions = rng.integers(0, 4096, (2, 5))
    rotary = spec.Rotary(theta=500000.0, scaling=LLAMA3)
    inv = rotary.inverse_frequencies(head_dim).astype(np.float32)
    angles = positions.astype(np.float32)[..., None] * inv  # (B, T, dh/2), float32
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, :, None]
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, :, None]
    heads = q.reshape(2, 5, 3, head_dim)
    halves = np.concatenate([-heads[..., head_dim // 2 :], heads[..., : head_dim // 2]], -1)
    expected = (heads * cos + halves * sin).reshape(q.shape)
    got = spec.rotate(OPS, q, positions, rotary, 3, head_dim)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rotation_runs_in_float32_and_rounds_once(dtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 8)).astype(dtype)
    positions = rng.integers(0, 2000, (2, 4))
    rotary = spec.Rotary()
    cos, _ = spec.rotary_tables(OPS, x, positions, rotary, 4)
    assert cos.dtype == np.float32
    got = spec.rotate(OPS, x, positions, rotary, 2, 4)
    assert got.dtype == dtype
    in_float32 = spec.rotate(OPS, x.astype(np.float32), positions, rotary, 2, 4)
    np.testing.assert_array_equal(got, in_float32.astype(dtype))
    exact = spec.rotate(OPS, x.astype(np.float64), positions, rotary, 2, 4)
    # Angles of float32 products: position 2000 is off by up to 2000 * 2**-24.
    np.testing.assert_allclose(in_float32, exact, rtol=0, atol=2e-3)
    assert spec.rotary_tables(OPS, x.astype(np.float64), positions, rotary, 4)[0].dtype == (
        np.float64
    )


def test_inverse_frequencies():
    np.testing.assert_allclose(
        spec.Rotary().inverse_frequencies(8), [1.0, 0.1, 0.01, 0.001], rtol=1e-15
    )
    for rotary, head_dim in [
        ({"theta": 500000.0, "scaling": LLAMA3}, 8),
        ({"scaling": {**LLAMA3, "original_max_position_embeddings": 8192}}, 128),
        ({"theta": 500000.0, "fraction": 0.5, "scaling": {**LLAMA3, "factor": 32.0}}, 64),
    ]:
        got = spec.check_rotary(rotary).inverse_frequencies(head_dim)
        expected = loop_inverse_frequencies(
            head_dim, rotary.get("theta", 10000.0), rotary.get("fraction", 1.0), rotary["scaling"]
        )
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, expected, rtol=1e-14, atol=0)
    # Every branch of Llama 3's scaling at head_dim 8 with a 64-position context:
    # kept (wavelength 6.3), interpolated (63), divided (628, 6283).
    scaled = spec.Rotary(scaling=LLAMA3).inverse_frequencies(8)
    unscaled = spec.Rotary().inverse_frequencies(8)
    ratio = unscaled / scaled
    assert ratio[0] == 1.0 and 1.0 < ratio[1] < 8.0 and ratio[2] == ratio[3] == 8.0


def test_rotary_accepts_transformers_rope_scaling():
    rotary = spec.check_rotary({"scaling": {"rope_type": "llama3", **LLAMA3}})
    assert rotary.scaling == spec.Llama3Scaling(**LLAMA3)
    assert spec.check_rotary(None) is None
    assert spec.check_rotary(rotary) is rotary
    assert spec.Rotary(fraction=0.5).dim(12) == 6


# -- ALiBi --------------------------------------------------------------------


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 8, 12, 16, 24])
def test_alibi_slopes_are_the_paper_and_bloom_slopes(num_heads):
    np.testing.assert_allclose(
        spec.alibi_slopes(num_heads), paper_slopes(num_heads), rtol=1e-14, atol=0
    )


def test_alibi_slopes_of_8_and_12_heads():
    eight = [2.0**-k for k in range(1, 9)]
    np.testing.assert_array_equal(spec.alibi_slopes(8), eight)
    # BLOOM: 8 slopes, then 2 ** (-4 k / 8) for k = 1, 3, 5, 7.
    twelve = eight + [2.0 ** (-0.5 * k) for k in (1, 3, 5, 7)]
    np.testing.assert_allclose(spec.alibi_slopes(12), twelve, rtol=1e-15, atol=0)


# -- masks, the window, bias edges --------------------------------------------


def test_window_rule_written_out():
    # Q = 3 queries at 2, 3, 4 among K = 5 keys; window 2, with and without causal.
    visible = spec.visibility(OPS, 3, 5, None, window=2)
    expected = [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    np.testing.assert_array_equal(visible, np.array(expected, bool))
    causal = spec.visibility(OPS, 3, 5, None, causal=True, window=2)
    expected = [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    np.testing.assert_array_equal(causal, np.array(expected, bool))
    positions = np.array([[0, 1, 2], [4, 5, 6]])
    own = spec.visibility(OPS, 3, 5, None, causal=True, window=2, query_positions=positions)
    assert own.shape == (2, 1, 3, 5)
    np.testing.assert_array_equal(own[0, 0], np.tri(3, 5, dtype=bool) & ~np.tri(3, 5, -2, bool))
    np.testing.assert_array_equal(own[1, 0].sum(-1), [2, 1, 0])  # at 4, 5, 6 among 5 keys


def test_a_hidden_key_stays_hidden_whatever_its_bias():
    weights, inputs, _ = setup(6)
    lens = np.array([2, 4])
    plain = spec.reference_forward(weights, *inputs.values(), lens, num_heads=4)
    bias = np.zeros((2, 1, 1, 5))
    bias[0, ..., 3:] = np.inf
    bias[1, ..., 4] = np.nan
    biased = spec.reference_forward(weights, *inputs.values(), lens, num_heads=4, bias=bias)
    for a, b in zip(plain, biased, strict=True):
        np.testing.assert_array_equal(a, b)
    bias[0, ..., 1] = np.nan  # a visible key: its rows are NaN, as the reference's softmax
    out, _ = spec.reference_forward(weights, *inputs.values(), lens, num_heads=4, bias=bias)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


def test_a_window_hidden_row_is_uniform():
    # Lengths 2 and a window of 1 leave query 4 (at position 4) no key: 1/K each.
    weights, inputs, _ = setup(7)
    _, attn = spec.reference_forward(
        weights, *inputs.values(), np.array([2, 5]), num_heads=4, window=1
    )
    np.testing.assert_array_equal(attn[0, :, 4], np.full((4, 5), 0.2))
    assert (attn[1, :, 4] == np.eye(5)[4]).all()


# -- gradients ----------------------------------------------------------------

GRADIENTS = {
    "everything, grouped, bias (B, 1, Q, K)": (
        {"num_kv_heads": 2, "scale": 2.0, "bias": True},
        {
            "rotary": {"fraction": 0.5, "scaling": LLAMA3},
            "alibi": True,
            "window": 3,
            "softcap": 2.0,
            "causal": True,
            "valid_lens": np.array([5, 3]),
            "positions": "ragged",
            "bias": (2, 1, 5, 5),
            "head_mask": np.array([1.0, 0.5, 0.0, 2.0]),
        },
    ),
    "interleaved rotary, softcap, bias (H, Q, 1), cross-attention": (
        {"num_queries": 3, "num_keys": 6, "head_dim": 8, "num_heads": 2},
        {
            "rotary": {"interleaved": True, "fraction": 0.75},
            "softcap": 1.0,
            "bias": (2, 3, 1),
            "window": 4,
        },
    ),
    "YaRN's attention factor, half rotated, cross-attention": (
        {"num_queries": 3, "num_keys": 6, "head_dim": 8, "num_heads": 2},
        {
            "rotary": {
                "fraction": 0.5,
                "scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
            "causal": True,
            "bias": (2, 3, 1),
        },
    ),
    "LongRoPE at ragged positions beyond its context": (
        {"num_kv_heads": 2},
        {
            "rotary": {
                "scaling": spec.LongRopeScaling(
                    short_factor=[1.0, 2.0],
                    long_factor=[3.0, 5.0],
                    original_max_position_embeddings=2,
                    attention_factor=1.2,
                )
            },
            "causal": True,
            "positions": "ragged",
            "bias": (),
        },
    ),
    "ALiBi with 3 heads and a bias ()": (
        {"num_heads": 3, "num_queries": 4, "num_keys": 4},
        {"alibi": True, "bias": (), "valid_lens": np.array([[4, 1, 0, 3], [2, 4, 4, 1]])},
    ),
}


@pytest.mark.parametrize("name", list(GRADIENTS))
def test_reference_gradients_match_finite_differences(name):
    setup_kwargs, kwargs = GRADIENTS[name]
    weights, inputs, rng = setup(8, **setup_kwargs)
    batch, num_queries = inputs["queries"].shape[:2]
    kwargs = call_arguments(kwargs, rng, batch, num_queries)
    valid_lens = kwargs.pop("valid_lens", None)
    kwargs["num_heads"] = setup_kwargs.get("num_heads", 4)
    kwargs["num_kv_heads"] = setup_kwargs.get("num_kv_heads")
    cotangent = rng.standard_normal((batch, num_queries, weights["W_o"].shape[1]))
    arrays = {**inputs, **weights, "bias": kwargs.pop("bias")}
    if "head_mask" in kwargs:
        arrays["head_mask"] = kwargs.pop("head_mask")

    def loss():
        extra = {"head_mask": arrays["head_mask"]} if "head_mask" in arrays else {}
        out, _ = spec.reference_forward(
            {n: arrays[n] for n in weights},
            arrays["queries"],
            arrays["keys"],
            arrays["values"],
            valid_lens,
            bias=arrays["bias"],
            **extra,
            **kwargs,
        )
        return float(np.sum(out * cotangent))

    grads = spec.reference_gradients(
        weights,
        *inputs.values(),
        valid_lens,
        output_gradient=cotangent,
        bias=arrays["bias"],
        **({"head_mask": arrays["head_mask"]} if "head_mask" in arrays else {}),
        **kwargs,
    )
    assert set(grads) == set(arrays)
    assert_central_differences(grads, arrays, loss, rng=rng, entries=8)


def test_bias_gradient_is_zero_where_keys_are_hidden():
    weights, inputs, rng = setup(9)
    bias = rng.standard_normal((2, 4, 5, 5))
    grads = spec.reference_gradients(
        weights,
        *inputs.values(),
        np.array([2, 5]),
        num_heads=4,
        causal=True,
        window=2,
        bias=bias,
        output_gradient=rng.standard_normal((2, 5, 16)),
    )
    visible = spec.visibility(OPS, 5, 5, np.array([2, 5]), causal=True, window=2)
    hidden = ~np.broadcast_to(visible, bias.shape)
    assert (grads["bias"][hidden] == 0).all() and np.abs(grads["bias"][~hidden]).max() > 0.1


# -- the cache ----------------------------------------------------------------

CACHED_OPTIONS = {
    "rotary": {"theta": 50.0, "scaling": {**LLAMA3, "original_max_position_embeddings": 8}},
    "window": 3,
    "alibi": True,
    "softcap": 3.0,
}


def cached_setup(seed, num_kv_heads):
    weights, inputs, rng = setup(
        seed, batch=3, num_queries=7, num_keys=7, num_kv_heads=num_kv_heads, head_dim=4
    )
    lengths = rng.integers(1, 8, size=3)
    return weights, inputs, lengths, rng


def reference_step(weights, heads, max_length, **options):
    shape = spec.cache_shape(3, max_length, heads)
    state = {"cache": spec.KVCache(np.zeros(shape), np.zeros(shape), np.zeros(3, np.int32))}

    def step(queries, keys, values, new_lens):
        output, _, state["cache"] = spec.reference_cached_forward(
            weights,
            queries,
            keys,
            values,
            state["cache"],
            new_lens,
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            causal=True,
            **options,
        )
        return output

    return step


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_cached_chunks_equal_one_full_call(seed, num_kv_heads):
    weights, inputs, lengths, rng = cached_setup(seed, num_kv_heads)
    heads = spec.heads_of_weights(weights, 4, num_kv_heads=num_kv_heads)
    full, _ = spec.reference_forward(
        weights, *inputs.values(), lengths, num_heads=4, causal=True, **CACHED_OPTIONS
    )
    real = np.arange(7) < lengths[:, None]
    expected = np.where(real[..., None], full, 0.0)
    step = reference_step(weights, heads, 9, **CACHED_OPTIONS)
    got = decode(step, inputs, lengths, random_schedule(rng, lengths))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def spec_cached_call(weights, heads, layer, cache, queries, keys, values, new_lens, bias):
    """A cached call written with the spec's functions, as a backend writes it."""

    def linear(x, name):
        y = x @ weights[f"W_{name}"]
        return y + weights[f"b_{name}"] if f"b_{name}" in weights else y

    q, k, v = linear(queries, "q"), linear(keys, "k"), linear(values, "v")
    positions, _ = spec.call_positions(
        OPS, None, num_queries=q.shape[1], num_keys=None, lengths=cache.lengths
    )
    q = spec.rotate(OPS, q, positions, layer.rotary, heads.num_heads, heads.head_dim)
    k = spec.rotate(OPS, k, positions, layer.rotary, heads.num_kv_heads, heads.head_dim)
    options = layer.score_options(num_heads=heads.num_heads, bias=bias, query_positions=positions)
    context, attention_weights, cache = cached_attention(
        heads, cache, q, k, v, new_lens, causal=True, options=options
    )
    return linear(context, "o"), attention_weights, cache


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_spec_cached_call_is_the_cached_reference(num_kv_heads):
    weights, inputs, _, rng = cached_setup(10, num_kv_heads)
    heads = spec.heads_of_weights(weights, 4, num_kv_heads=num_kv_heads)
    layer = spec.LayerOptions.of(CACHED_OPTIONS)
    shape = spec.cache_shape(3, 9, heads)
    caches = [spec.KVCache(np.zeros(shape), np.zeros(shape), np.zeros(3, np.int32))] * 2
    start = 0
    for num_new, new_lens in [(3, [3, 1, 0]), (3, [2, 3, 1]), (1, [1, 1, 1])]:
        rows = [x[:, start : start + num_new] for x in inputs.values()]
        bias = rng.standard_normal((3, 1, num_new, 9))
        new_lens = np.array(new_lens, np.int32)
        *expected, caches[0] = spec.reference_cached_forward(
            weights,
            *rows,
            caches[0],
            new_lens,
            num_heads=4,
            num_kv_heads=num_kv_heads,
            causal=True,
            bias=bias,
            **CACHED_OPTIONS,
        )
        *got, caches[1] = spec_cached_call(weights, heads, layer, caches[1], *rows, new_lens, bias)
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
        np.testing.assert_allclose(caches[1].keys, caches[0].keys, rtol=0, atol=1e-12)
        start += num_new


def test_cached_positions_default_to_each_examples_own():
    lengths = np.array([3, 0], np.int32)
    positions, keys = spec.call_positions(OPS, None, num_queries=2, num_keys=None, lengths=lengths)
    np.testing.assert_array_equal(positions, [[3, 4], [0, 1]])
    assert keys is positions
    given = np.array([[7, 8]])
    q, k = spec.call_positions(OPS, given, num_queries=2, num_keys=2)
    assert q is given and k is given
    q, k = spec.call_positions(OPS, None, num_queries=2, num_keys=3)
    np.testing.assert_array_equal(q, [0, 1])
    np.testing.assert_array_equal(k, [0, 1, 2])


# -- errors -------------------------------------------------------------------

ERRORS = [
    (lambda: spec.check_rotary(5), TypeError, "rotary must be None"),
    (lambda: spec.check_rotary({"base": 2.0}), ValueError, r"unknown keys \['base'\]"),
    (lambda: spec.Rotary(theta=0), ValueError, "rotary.theta"),
    (lambda: spec.Rotary(theta="1e4"), TypeError, "rotary.theta"),
    (lambda: spec.Rotary(fraction=1.5), ValueError, "rotary.fraction"),
    (lambda: spec.Rotary(interleaved=1), TypeError, "rotary.interleaved"),
    (lambda: spec.Rotary(scaling=8.0), TypeError, "rotary.scaling"),
    (lambda: spec.Rotary(scaling={"factor": 8.0}), ValueError, "missing"),
    (
        lambda: spec.Rotary(scaling={**LLAMA3, "rope_type": "ntk"}),
        ValueError,
        r"rope_type must be one of 'linear', .* got 'ntk'",
    ),
    (
        lambda: spec.Rotary(scaling={**LLAMA3, "rope_type": "yarn"}),
        ValueError,
        r"rope_type 'yarn' .* unknown \['high_freq_factor', 'low_freq_factor'\]",
    ),
    (
        lambda: spec.Rotary(scaling={**LLAMA3, "high_freq_factor": 1.0}),
        ValueError,
        "high_freq_factor",
    ),
    (
        lambda: spec.Rotary(scaling={**LLAMA3, "original_max_position_embeddings": 64.0}),
        TypeError,
        "original_max_position_embeddings",
    ),
    (lambda: spec.Rotary(scaling={**LLAMA3, "factor": -1}), ValueError, "scaling.factor"),
    (lambda: spec.Rotary(fraction=0.5).dim(6), ValueError, r"rotary.fraction .* rotates 3"),
    (lambda: spec.check_window(0), ValueError, "window"),
    (lambda: spec.check_window(2.0), TypeError, "window"),
    (lambda: spec.check_window(True), TypeError, "window"),
    (lambda: spec.check_softcap(0.0), ValueError, "softcap"),
    (lambda: spec.check_softcap(float("inf")), ValueError, "softcap"),
    (lambda: spec.check_softcap("30"), TypeError, "softcap"),
    (lambda: spec.check_alibi(1), TypeError, "alibi must be a bool"),
    (lambda: spec.alibi_slopes(0), ValueError, "num_heads"),
    (
        lambda: spec.check_positions((2, 3), "f", batch=2, num_queries=3),
        TypeError,
        "positions must be integers",
    ),
    (
        lambda: spec.check_positions((2, 4), "i", batch=2, num_queries=3),
        ValueError,
        r"positions must have shape \(batch, num_queries\) = \(2, 3\)",
    ),
    (
        lambda: spec.check_positions((2, 3), "i", batch=2, num_queries=3, num_keys=4),
        ValueError,
        "3 queries and 4 keys",
    ),
    (
        lambda: spec.check_bias((2, 4, 3, 5), "i", batch=2, num_heads=4, num_queries=3, num_keys=5),
        TypeError,
        "bias must be a floating-point array",
    ),
    (
        lambda: spec.check_bias((3, 1, 1, 1), "f", batch=2, num_heads=4, num_queries=3, num_keys=5),
        ValueError,
        r"broadcastable to .* \(2, 4, 3, 5\); got shape \(3, 1, 1, 1\)",
    ),
    (
        lambda: spec.check_bias((1,) * 5, "f", batch=2, num_heads=4, num_queries=3, num_keys=5),
        ValueError,
        "broadcastable",
    ),
    (lambda: spec.LayerOptions.of({"rope": {}}), TypeError, r"unknown option\(s\) \['rope'\]"),
    (lambda: spec.LayerOptions(window=-1).check(), ValueError, "window"),
]


@pytest.mark.parametrize(("make", "error", "match"), ERRORS)
def test_errors_name_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_reference_checks_the_call_arguments():
    weights, inputs, _ = setup(11, num_queries=3, num_keys=5)
    with pytest.raises(ValueError, match="3 queries and 5 keys"):
        spec.reference_forward(
            weights, *inputs.values(), num_heads=4, positions=np.zeros((2, 3), int), rotary={}
        )
    with pytest.raises(ValueError, match="bias must be broadcastable"):
        spec.reference_forward(weights, *inputs.values(), num_heads=4, bias=np.zeros((5, 3)))
    with pytest.raises(TypeError, match="unknown option"):
        spec.reference_forward(weights, *inputs.values(), num_heads=4, sliding_window=3)
    with pytest.raises(ValueError, match="rotates 1 entries"):
        spec.reference_forward(weights, *inputs.values(), num_heads=4, rotary={"fraction": 0.25})


def test_layer_options():
    default = spec.LayerOptions()
    assert default.is_default and default.check() == default
    options = spec.LayerOptions.of({"rotary": {"theta": 5e5}, "alibi": True, "window": 4})
    assert options.rotary == spec.Rotary(theta=5e5) and not options.is_default
    scores = options.score_options(num_heads=3)
    np.testing.assert_array_equal(scores.alibi_slopes, spec.alibi_slopes(3))
    assert scores.window == 4 and scores.softcap is None and scores.adjusts_scores
    assert not spec.NO_OPTIONS.adjusts_scores


# -- the kernel plan ----------------------------------------------------------

# (kernel, facts, the fields that are true), each worked out from the rules.
PLANS = {
    "window into the mask of a kernel without one": (
        SDPA_WITH_BIAS,
        {"window": True, "causal": True},
        {"mask_causal", "mask_window"},
    ),
    "window as the kernel's own where the frames agree": (
        WINDOWED,
        {"window": True, "causal": True},
        {"is_causal", "window_flag"},
    ),
    "window into the mask for Q < K": (
        WINDOWED,
        {"window": True, "causal": True, "sizes": (2, 3, 5)},
        {"mask_causal", "mask_window"},
    ),
    "window beside lengths read as > 0: rows may still be hidden": (
        WINDOWED,
        {"window": True, "lens_ndim": 1, "shortest_length": 2.0},
        {"key_lengths", "window_flag", "fix_rows", "fix_window"},
    ),
    "window beside lengths that hide nothing: no row hidden": (
        SDPA_WITH_BIAS,
        {"window": True, "lens_ndim": 1, "shortest_length": 9.0, "causal": True},
        {"mask_causal", "mask_window"},
    ),
    "own query positions: causal and window in the mask, rows fixed": (
        WINDOWED,
        {"window": True, "causal": True, "query_positions": True, "lens_ndim": 2},
        {"mask_lens", "mask_causal", "mask_window", "fix_rows", "fix_causal", "fix_window"},
    ),
    "cached call: lengths carry causal, window in the mask": (
        WINDOWED,
        {"window": True, "query_positions": True, "lens_ndim": 2, "sizes": (2, 4, 4)},
        {"mask_lens", "mask_window", "fix_rows", "fix_window"},
    ),
    "bias to a kernel that takes it": (SDPA_WITH_BIAS, {"bias": True}, {"bias"}),
    "softcap to a kernel that takes it": (SOFTCAPPED, {"softcap": True}, {"softcap"}),
    "uniform hidden rows need no fix for a window": (
        UNIFORM,
        {"window": True, "lens_ndim": 1, "causal": True},
        {"mask_lens", "mask_causal", "mask_window"},
    ),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_kernel_plan_with_options(name):
    assert_fused(*PLANS[name])


GENERIC = {
    "bias, the kernel takes none": (SOFTCAPPED, {"bias": True}, "bias"),
    "softcap, the kernel has none": (WINDOWED, {"softcap": True}, "soft-capping"),
    "dropout beside a window that may hide rows": (
        SDPA_WITH_BIAS,
        {"dropout": True, "window": True, "lens_ndim": 1, "shortest_length": 3.0},
        "dropout",
    ),
}


@pytest.mark.parametrize("name", sorted(GENERIC))
def test_kernel_plan_generic_for_options(name):
    assert_generic(*GENERIC[name])


def _kernel_visibility(plan, num_queries, num_keys, lens, options):
    """What a kernel sees: its mask, its own top-left flags and key lengths, combined."""
    visible = np.ones((1, 1, num_queries, num_keys), bool)
    mask = plan.mask(OPS, num_queries, num_keys, lens, options)
    if mask is not None:
        visible = visible & mask
    rows, cols = np.arange(num_queries)[:, None], np.arange(num_keys)
    if plan.is_causal:
        visible = visible & (cols <= rows)
    if plan.window_flag:
        visible = visible & (rows - cols < options.window)
    if plan.key_lengths:
        visible = visible & (cols < lens[:, None, None, None])
    return visible


@pytest.mark.parametrize("kernel", [SDPA_WITH_BIAS, WINDOWED], ids=lambda k: k.name)
def test_kernel_plan_sees_the_spec_visibility_and_fixes_exactly_the_hidden_rows(kernel):
    rng = np.random.default_rng(12)
    for _ in range(300):
        batch, num_queries, num_keys = 2, int(rng.integers(1, 6)), int(rng.integers(1, 6))
        causal, window = bool(rng.integers(2)), [None, 1, 2, 4][rng.integers(4)]
        lens_ndim = [None, 1, 2][rng.integers(3)]
        lens = None
        if lens_ndim is not None:
            shape = (batch,) if lens_ndim == 1 else (batch, num_queries)
            lens = rng.integers(0, num_keys + 2, shape)
        positions = None
        if rng.integers(2):
            positions = rng.integers(0, 8, (batch, num_queries))
        options = spec.ScoreOptions(window=window, query_positions=positions)
        plan = spec.plan_kernel(
            kernel,
            sizes=(batch, num_queries, num_keys),
            lens_ndim=lens_ndim,
            causal=causal,
            window=window is not None,
            query_positions=positions is not None,
            values_exact=True,
            shortest_length=None if lens is None else float(lens.min()),
        )
        assert plan.fused, plan.reason
        expected = spec.visibility(
            OPS,
            num_queries,
            num_keys,
            lens,
            causal=causal,
            window=window,
            query_positions=positions,
        )
        expected = np.ones((1, 1, num_queries, num_keys), bool) if expected is None else expected
        expected = np.broadcast_to(expected, (batch, 1, num_queries, num_keys))
        seen = _kernel_visibility(plan, num_queries, num_keys, lens, options)
        np.testing.assert_array_equal(np.broadcast_to(seen, expected.shape), expected)
        hidden_rows = ~expected.any(-1)
        fix = plan.fix_visibility(OPS, num_queries, num_keys, lens, options)
        if fix is None:
            assert not hidden_rows.any()
        else:
            fixed = ~np.broadcast_to(fix, expected.shape).any(-1)
            np.testing.assert_array_equal(fixed, hidden_rows)


def test_score_bias_is_what_a_kernel_adds():
    rng = np.random.default_rng(13)
    scores = rng.standard_normal((2, 3, 4, 6)).astype(np.float32)
    bias = rng.standard_normal((2, 1, 4, 6))
    positions = np.array([[2, 3, 4, 5], [0, 1, 2, 3]])
    options = spec.ScoreOptions(
        bias=bias, alibi_slopes=spec.alibi_slopes(3), query_positions=positions
    )
    added = spec.score_bias(OPS, options, 4, 6, scores)
    assert added.dtype == np.float32 and added.shape == (2, 3, 4, 6)
    slopes = spec.alibi_slopes(3)[:, None, None]
    offsets = np.arange(6) - positions[:, None, :, None]  # j - i_abs
    np.testing.assert_allclose(added, bias + slopes * offsets, rtol=1e-6, atol=1e-6)
    capped = spec.adjust_scores(OPS, scores, spec.ScoreOptions(softcap=0.5, bias=bias))
    np.testing.assert_allclose(capped, 0.5 * np.tanh(scores / 0.5) + bias, rtol=1e-6, atol=1e-6)
    assert spec.score_bias(OPS, spec.NO_OPTIONS, 4, 6, scores) is None
