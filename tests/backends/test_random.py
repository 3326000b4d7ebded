"""Randomised configurations against the float64 reference, in every backend."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mha_multi import spec
from mha_multi.weights import init_weights


@st.composite
def configurations(draw):
    batch = draw(st.integers(1, 3))
    num_queries = draw(st.integers(1, 6))
    num_keys = draw(st.integers(1, 6))
    num_heads = draw(st.integers(1, 3))
    num_hiddens = num_heads * draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 6)) for _ in range(3)]
    lens_kind = draw(st.sampled_from(["none", "1d", "2d"]))
    # Lengths from below zero (everything hidden) to past K (nothing hidden).
    lengths = st.integers(-2, num_keys + 3)
    valid_lens = None
    if lens_kind == "1d":
        valid_lens = draw(st.lists(lengths, min_size=batch, max_size=batch))
    elif lens_kind == "2d":
        valid_lens = draw(
            st.lists(
                st.lists(lengths, min_size=num_queries, max_size=num_queries),
                min_size=batch,
                max_size=batch,
            )
        )
    lens_dtype = draw(st.sampled_from(["int32", "int64", "float32"]))
    return {
        "batch": batch,
        "num_queries": num_queries,
        "num_keys": num_keys,
        "num_heads": num_heads,
        "num_hiddens": num_hiddens,
        "sizes": sizes,
        "bias": draw(st.booleans()),
        "causal": draw(st.booleans()),
        "valid_lens": None if valid_lens is None else np.asarray(valid_lens, lens_dtype),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(
    # The example count comes from the hypothesis profile (conftest.py): a few
    # dozen in the default run, many more in the opt-in ``exhaustive`` session.
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(config=configurations())
def test_random_configurations_match_reference(runner, config):
    rng = np.random.default_rng(config["seed"])
    query_size, key_size, value_size = config["sizes"]
    weights = init_weights(
        config["num_hiddens"],
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
        bias=config["bias"],
        seed=config["seed"],
    )
    b, q, k = config["batch"], config["num_queries"], config["num_keys"]
    queries = rng.standard_normal((b, q, query_size)).astype(np.float32)
    keys = rng.standard_normal((b, k, key_size)).astype(np.float32)
    values = rng.standard_normal((b, k, value_size)).astype(np.float32)
    layer = runner.make_layer(
        config["num_hiddens"],
        config["num_heads"],
        bias=config["bias"],
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
    )
    layer = runner.set_weights(layer, weights)
    args = (layer, queries, keys, values, config["valid_lens"])
    expected, expected_weights = spec.reference_forward(
        weights,
        queries,
        keys,
        values,
        config["valid_lens"],
        num_heads=config["num_heads"],
        causal=config["causal"],
    )
    output = runner.call(*args, causal=config["causal"])
    with_weights, attention = runner.call(
        *args, causal=config["causal"], return_attention_weights=True
    )
    np.testing.assert_allclose(output, expected, rtol=0, atol=5e-6)
    np.testing.assert_allclose(with_weights, expected, rtol=0, atol=5e-6)
    np.testing.assert_allclose(attention, expected_weights, rtol=0, atol=5e-6)
