"""The rotary types in the spec: frequencies, attention factors, the call's length, the cache.

Each type's frequencies against a loop written out here, one pair at a
time, from transformers' formulas (docs: "Positions and biases"); the
length a call's tables are chosen by; cached decoding against one full
call where the docs say they agree, and where they say they differ.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mha_multi import spec
from mha_multi.parity.decode import decode
from mha_multi.weights import init_weights

LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 2.0, 4.0],
    "long_factor": [2.0, 4.0, 8.0, 16.0],
    "original_max_position_embeddings": 4,
    "factor": 8.0,
}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4}


def loop_frequencies(scaling, theta, dim, length):
    """One frequency at a time, from transformers' formulas for each rope_type."""
    kind = scaling["rope_type"]
    frequencies = []
    for pair in range(dim // 2):
        exponent = 2 * pair / dim
        if kind == "linear":
            frequencies.append(theta**-exponent / scaling["factor"])
        elif kind == "dynamic":
            most = scaling["max_position_embeddings"]
            seen = max(length, most)
            base = theta * (scaling["factor"] * seen / most - (scaling["factor"] - 1)) ** (
                dim / (dim - 2)
            )
            frequencies.append(base**-exponent)
        elif kind == "longrope":
            beyond = length > scaling["original_max_position_embeddings"]
            factor = scaling["long_factor" if beyond else "short_factor"][pair]
            frequencies.append(1 / (factor * theta**exponent))
        elif kind == "yarn":
            original = scaling["original_max_position_embeddings"]

            def dimension(turns, original=original):
                return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

            low = max(math.floor(dimension(scaling.get("beta_fast", 32))), 0)
            high = min(math.ceil(dimension(scaling.get("beta_slow", 1))), dim - 1)
            high = high + 0.001 if low == high else high
            ramp = min(max((pair - low) / (high - low), 0.0), 1.0)
            plain = theta**-exponent
            frequencies.append(plain / scaling["factor"] * ramp + plain * (1 - ramp))
    return np.array(frequencies)


CASES = {
    "linear": ({"rope_type": "linear", "factor": 3.0}, 1.0),
    "dynamic within": (DYNAMIC, 1.0),
    "longrope": (LONGROPE, math.sqrt(1 + math.log(8.0) / math.log(4))),
    "longrope with its attention factor": ({**LONGROPE, "attention_factor": 0.9}, 0.9),
    "yarn": (
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256},
        0.1 * math.log(16.0) + 1,
    ),
    "yarn with DeepSeek's mscales": (
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 8.0,
            "mscale": 0.8,
            "mscale_all_dim": 0.5,
        },
        (0.08 * math.log(16.0) + 1) / (0.05 * math.log(16.0) + 1),
    ),
}


@pytest.mark.parametrize("length", [3, 4, 5, 40])
@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_attention_factor_are_transformers_formulas(name, length):
    scaling, attention = CASES[name]
    rotary = spec.Rotary(theta=500.0, scaling=scaling)
    expected = loop_frequencies(scaling, 500.0, 8, length)
    got = rotary.inverse_frequencies(8, length)
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=0)
    assert rotary.scaling.attention_scaling() == pytest.approx(attention, rel=1e-14)
    # The tables: positions times the frequencies, cos and sin times the factor.
    positions = np.array([[0, 2, length - 1]])
    cos, sin = spec.rotary_tables(spec.NumpyOps(), np.zeros(1), positions, rotary, 8)
    angles = positions[..., None, None] * expected
    np.testing.assert_allclose(cos, attention * np.cos(angles), rtol=0, atol=1e-13)
    np.testing.assert_allclose(sin, attention * np.sin(angles), rtol=0, atol=1e-13)


def test_the_length_is_the_largest_position_of_the_call_over_the_batch():
    """Not each example's own: one example beyond the context switches the whole batch."""
    rotary = spec.Rotary(scaling=LONGROPE)
    positions = np.array([[0, 1, 2], [5, 6, 7]])  # length 8 > 4: the long factors
    cos, _ = spec.rotary_tables(spec.NumpyOps(), np.zeros(1), positions, rotary, 8)
    long = rotary.inverse_frequencies(8, 8)
    factor = rotary.scaling.attention_scaling()
    np.testing.assert_allclose(cos[0, :, 0], factor * np.cos(positions[0, :, None] * long))
    assert spec.rotary_length(spec.NumpyOps(), positions) == 8
    assert spec.rotary_length(spec.NumpyOps(), np.arange(3), np.arange(5)) == 5
    assert spec.rotary_length(spec.NumpyOps(), np.zeros((2, 0), np.int64)) == 0


def cached_and_full(rotary, schedule, total=6):
    """One example's outputs at its positions: decoded by ``schedule``, and in one call."""
    weights = init_weights(16, num_heads=2, seed=3)
    rng = np.random.default_rng(4)
    inputs = {name: rng.standard_normal((1, total, 16)) for name in ("queries", "keys", "values")}
    options = {"num_heads": 2, "causal": True, "rotary": rotary}
    state = {"cache": spec.KVCache(np.zeros((1, 2, total, 8)), np.zeros((1, 2, total, 8)), [0])}

    def step(queries, keys, values, new_lens):
        output, _, state["cache"] = spec.reference_cached_forward(
            weights, queries, keys, values, state["cache"], new_lens, **options
        )
        return output

    cached = decode(step, inputs, np.array([total]), [(n, [n]) for n in schedule])
    full, _ = spec.reference_forward(weights, *inputs.values(), **options)
    return cached, full


@pytest.mark.parametrize(
    ("scaling", "schedule", "equal"),
    [
        # Every call within the original context: the frequencies never change.
        ({**DYNAMIC, "max_position_embeddings": 6}, [2, 1, 3], True),
        ({**LONGROPE, "original_max_position_embeddings": 6}, [3, 1, 1, 1], True),
        # LongRoPE whose prefill already passes the context: the long factors throughout.
        (LONGROPE, [5, 1], True),
        # Keys written before the switch keep their angles: not the full call's.
        (LONGROPE, [3, 1, 2], False),
        (DYNAMIC, [5, 1], False),
    ],
)
def test_cached_decoding_equals_one_call_exactly_when_the_docs_say(scaling, schedule, equal):
    cached, full = cached_and_full({"theta": 100.0, "scaling": scaling}, schedule)
    error = np.abs(cached - full).max()
    assert error < 1e-12 if equal else error > 1e-3, error


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        DYNAMIC,
        LONGROPE,
        CASES["yarn with DeepSeek's mscales"][0],
    ],
)
def test_a_scaling_round_trips_as_plain_values(scaling):
    rotary = spec.Rotary(theta=50.0, fraction=1.0, scaling=scaling)
    config = spec.LayerOptions(rotary=rotary).config()["rotary"]
    assert config["scaling"]["rope_type"] == scaling["rope_type"]
    assert spec.check_rotary(config) == rotary
    kind = type(rotary.scaling)
    assert getattr(spec, kind.__name__) is kind and kind.__module__ == "mha_multi.spec"


def test_llama3_dicts_without_a_type_still_read_as_llama3():
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert spec.Rotary(scaling=llama3).scaling == spec.Llama3Scaling(**llama3)
    assert spec.Rotary(scaling={**llama3, "type": "llama3"}).scaling == spec.Llama3Scaling(**llama3)


def test_transformers_default_type_is_no_scaling():
    """A config's ``{"rope_type": "default"}`` (or ``type``) as it is: the frequencies
    ``theta ** (-2i / dim)``, as ``scaling=None`` computes them."""
    for scaling in ({"rope_type": "default"}, {"type": "default"}):
        assert spec.Rotary(scaling=scaling) == spec.Rotary()


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: spec.Rotary(scaling={"rope_type": "dynamic", "factor": 2.0}),
            ValueError,
            r"missing \['max_position_embeddings'\]",
        ),
        (
            lambda: spec.Rotary(scaling={**DYNAMIC, "original_max_position_embeddings": 4}),
            ValueError,
            r"unknown \['original_max_position_embeddings'\]",
        ),
        (
            lambda: spec.Rotary(scaling={**LONGROPE, "factor": None}),
            ValueError,
            "needs factor .* or attention_factor",
        ),
        (
            lambda: spec.Rotary(scaling={**LONGROPE, "short_factor": "1.0"}),
            TypeError,
            "rotary.scaling.short_factor",
        ),
        (
            lambda: spec.Rotary(scaling={**LONGROPE, "long_factor": [1.0, 0.0, 1.0, 1.0]}),
            ValueError,
            r"rotary.scaling.long_factor\[1\]",
        ),
        (
            lambda: spec.Rotary(scaling=LONGROPE).dim(16),
            ValueError,
            r"rotary.scaling.short_factor must have one factor per rotated pair \(8\); got 4",
        ),
        (
            lambda: spec.Rotary(scaling={**CASES["yarn"][0], "truncate": "no"}),
            TypeError,
            "rotary.scaling.truncate",
        ),
        (
            lambda: spec.Rotary(scaling={**CASES["yarn"][0], "beta_fast": -1}),
            ValueError,
            "rotary.scaling.beta_fast",
        ),
        (
            lambda: spec.Rotary(scaling={"rope_type": "linear", "factor": 2.0, "type": "yarn"}),
            ValueError,
            "rope_type and type differ",
        ),
        (lambda: spec.LinearScaling(factor="2"), TypeError, "rotary.scaling.factor"),
        # (Division by ln(1) in the formulas: ZeroDivisionError at the first call before.)
        (
            lambda: spec.Rotary(
                scaling={**LONGROPE, "original_max_position_embeddings": 1, "factor": 2.0}
            ),
            ValueError,
            "with factor > 1 needs original_max_position_embeddings > 1 or attention_factor",
        ),
        (
            lambda: spec.Rotary(theta=1.0, scaling=CASES["yarn"][0]),
            ValueError,
            "rotary.theta must not be 1 with rope_type 'yarn'",
        ),
        (
            lambda: spec.Rotary(scaling={"rope_type": ["linear"], "factor": 2.0}),
            TypeError,
            r"rotary.scaling rope_type must be a string; got \['linear'\]",
        ),
        (lambda: spec.QKNorm(eps=1e-39), ValueError, r"qk_norm.eps must be at least 2\*\*-126"),
        (
            lambda: spec.Rotary(scaling={"rope_type": "default", "factor": 2.0}),
            ValueError,
            r"rope_type 'default' has no fields; got \['factor'\]",
        ),
    ],
)
def test_errors_name_the_field(make, error, match):
    with pytest.raises(error, match=match):
        make()
