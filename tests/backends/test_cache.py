"""Incremental decoding with a key/value cache, identically in every backend.

The defining property (docs: "Generating with a cache"): for any split of
ragged sequences into calls, a prefill of any length and then chunks of any
length (1 included), the outputs at the real positions are those of one
causal forward with ``valid_lens=lengths``. Each backend is checked against
the float64 reference: the full forward, the per-query loop of
:func:`mha_multi.spec.reference_cached_forward`, and finite differences of it
for the gradients of a cached call.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from option_cases import LENGTH_DEPENDENT_ROTARY
from parity_support import checks_within_tolerance

from mha_multi import spec
from mha_multi.parity.cases import CACHED_CASES, build_case
from mha_multi.parity.compare import tolerance
from mha_multi.parity.decode import chunk_rows, full_reference, random_schedule
from mha_multi.parity.runners import DTYPES
from mha_multi.weights import init_weights

CONFIGS = {
    "mha": {"num_hiddens": 8, "num_heads": 2, "bias": False},
    "gqa_bias": {"num_hiddens": 16, "num_heads": 4, "num_kv_heads": 2, "bias": True},
}
QUERY_SIZE = 5


@pytest.fixture(scope="module")
def cached_cases():
    return {config.name: build_case(config) for config in CACHED_CASES}


def layer_of(runner, weights, config, dtype="float32"):
    heads = {k: v for k, v in config.items() if k in ("num_kv_heads", "head_dim")}
    layer = runner.make_layer(
        config["num_hiddens"],
        config["num_heads"],
        bias=config["bias"],
        query_size=QUERY_SIZE,
        key_size=config["num_hiddens"],
        value_size=config["num_hiddens"],
        dtype=dtype,
        **heads,
    )
    return runner.set_weights(layer, weights)


def setup(name, seed, *, batch=3, length=6):
    config = CONFIGS[name]
    heads = {k: v for k, v in config.items() if k in ("num_kv_heads", "head_dim")}
    weights = init_weights(
        config["num_hiddens"],
        bias=config["bias"],
        seed=seed,
        num_heads=config["num_heads"],
        query_size=QUERY_SIZE,
        **heads,
    )
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    rng = np.random.default_rng(seed)
    sizes = {"queries": QUERY_SIZE, "keys": config["num_hiddens"], "values": config["num_hiddens"]}
    inputs = {
        k: rng.standard_normal((batch, length, size)).astype(np.float32)
        for k, size in sizes.items()
    }
    return config, weights, inputs, rng


def reference_heads(config):
    return {"num_heads": config["num_heads"], "num_kv_heads": config.get("num_kv_heads")}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", [c.name for c in CACHED_CASES])
def test_cached_case_within_tolerance(runner, available_device, dtype, case_name, cached_cases):
    checks = checks_within_tolerance(runner, available_device, dtype, cached_cases[case_name])
    assert {c.quantity for c in checks} == {"output", "output[weights]"}


# float32 only: the cached parity cases above hold every dtype, and each
# schedule's new call lengths cost eager JAX a compilation each.
@pytest.mark.parametrize("dtype", ["float32"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_any_schedule_equals_one_full_causal_forward(runner, name, seed, dtype):
    if not runner.dtype_supported("cpu", dtype):
        pytest.skip(f"{runner.name} has no {dtype}")
    config, weights, inputs, rng = setup(name, seed)
    lengths = rng.integers(0, 7, size=3)
    chunks = random_schedule(rng, lengths)
    layer = layer_of(runner, weights, config, dtype)
    expected = full_reference(weights, inputs, lengths, **reference_heads(config))
    for options in ({}, {"return_attention_weights": True}):
        actual = runner.decode(layer, inputs, lengths, chunks, max_length=8, dtype=dtype, **options)
        error = np.abs(actual - expected).max()
        assert error <= tolerance(dtype, "output"), (chunks, options, error)


def native(runner, rows, new_lens=None):
    arrays = [None if x is None else runner.to_native(x) for x in rows]
    return [*arrays, None if new_lens is None else runner.native_lens(new_lens)]


def cache_as_numpy(runner, cache):
    return spec.KVCache(
        runner.to_numpy(cache.keys),
        runner.to_numpy(cache.values),
        np.asarray(runner.to_numpy(cache.lengths)),
    )


def prefilled(runner, layer, inputs, new_lens, max_length):
    """A cache after one prefill call of ``inputs``' first 3 positions."""
    cache = runner.init_cache(layer, 3, max_length)
    rows = [x[:, :3] for x in inputs.values()]
    result = runner.forward(layer, *native(runner, rows, new_lens), causal=True, cache=cache)
    return result[-1]


@pytest.mark.parametrize("kind", sorted(LENGTH_DEPENDENT_ROTARY))
def test_a_rotary_of_the_calls_length_is_the_cached_reference(runner, kind):
    """A prefill within the original context, then a call past it (docs: "Positions
    and biases"): each call at its own length, the cached keys at theirs."""
    config, weights, inputs, _ = setup("gqa_bias", 5)
    rotary = {"theta": 100.0, "scaling": LENGTH_DEPENDENT_ROTARY[kind]}
    layer = runner.make_layer(
        16, 4, num_kv_heads=2, bias=True, query_size=QUERY_SIZE, rotary=rotary
    )
    layer = runner.set_weights(layer, weights)
    cache = runner.init_cache(layer, 3, 7)
    expected_cache = spec.KVCache(np.zeros((3, 2, 7, 4)), np.zeros((3, 2, 7, 4)), np.zeros(3))
    start = np.zeros(3, np.int64)
    for new_lens in (np.array([3, 1, 0]), np.array([2, 0, 3])):  # lengths 3, then 6
        rows = [chunk_rows(x, start, 3) for x in inputs.values()]
        output, cache = runner.forward(
            layer, *native(runner, rows, new_lens), causal=True, cache=cache
        )
        expected, _, expected_cache = spec.reference_cached_forward(
            weights,
            *rows,
            expected_cache,
            new_lens,
            **reference_heads(config),
            causal=True,
            rotary=rotary,
        )
        real = np.arange(3) < new_lens[:, None]
        error = np.abs(np.where(real[..., None], runner.to_numpy(output) - expected, 0)).max()
        assert error <= 5e-6, (kind, new_lens, error)
        start += new_lens


@pytest.mark.parametrize("kind", sorted(LENGTH_DEPENDENT_ROTARY))
def test_plain_decoding_steps_of_a_rotary_of_the_calls_length(runner, kind):
    """Self-attention steps at the default positions past the original context
    (the plainest calls a backend may serve on a fast route): each at its own length."""
    weights = init_weights(16, num_heads=4, num_kv_heads=2, seed=6)
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    rotary = {"theta": 100.0, "scaling": LENGTH_DEPENDENT_ROTARY[kind]}
    layer = runner.set_weights(runner.make_layer(16, 4, num_kv_heads=2, rotary=rotary), weights)
    x = np.random.default_rng(6).standard_normal((2, 6, 16)).astype(np.float32)
    cache = runner.init_cache(layer, 2, 6)
    expected_cache = spec.KVCache(np.zeros((2, 2, 6, 4)), np.zeros((2, 2, 6, 4)), np.zeros(2))
    for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6)):
        rows = runner.to_native(x[:, start:stop])
        output, cache = runner.forward(layer, rows, rows, rows, None, causal=True, cache=cache)
        expected, _, expected_cache = spec.reference_cached_forward(
            weights,
            *[x[:, start:stop]] * 3,
            expected_cache,
            num_heads=4,
            num_kv_heads=2,
            causal=True,
            rotary=rotary,
        )
        error = np.abs(runner.to_numpy(output) - expected).max()
        assert error <= 5e-6, (kind, stop, error)


@pytest.mark.parametrize("causal", [True, False])
def test_a_cached_call_is_the_per_query_loop(runner, causal):
    """Output, weights ``(B, H, T, max_length)`` and the cache after a second call."""
    config, weights, inputs, _ = setup("gqa_bias", 3)
    layer = layer_of(runner, weights, config)
    cache = prefilled(runner, layer, inputs, np.array([3, 1, 0]), 7)
    before = cache_as_numpy(runner, cache)
    assert before.lengths.tolist() == [3, 1, 0]
    new_lens = np.array([2, 0, 3])
    rows = [chunk_rows(x, before.lengths.astype(np.int64), 3) for x in inputs.values()]
    output, attention_weights, after = runner.forward(
        layer,
        *native(runner, rows, new_lens),
        causal=causal,
        cache=cache,
        return_attention_weights=True,
    )
    expected, expected_weights, expected_cache = spec.reference_cached_forward(
        weights, *rows, before, new_lens, **reference_heads(config), causal=causal
    )
    assert runner.to_numpy(attention_weights).shape == (3, 4, 3, 7)
    np.testing.assert_allclose(runner.to_numpy(output), expected, atol=5e-6, rtol=0)
    np.testing.assert_allclose(
        runner.to_numpy(attention_weights), expected_weights, atol=5e-6, rtol=0
    )
    after = cache_as_numpy(runner, after)
    assert after.lengths.tolist() == [5, 1, 3]
    for name in ("keys", "values"):
        # Positions past the lengths hold nothing the spec reads.
        held = np.arange(7) < after.lengths[:, None]
        kept, wanted = getattr(after, name), getattr(expected_cache, name)
        np.testing.assert_allclose(
            np.where(held[:, None, :, None], kept, 0),
            np.where(held[:, None, :, None], wanted, 0),
            atol=5e-6,
        )


def test_non_finite_values_past_the_filled_positions_reach_the_output(runner):
    """A hidden value takes a weight of 0, which a NaN or an infinity makes NaN, as
    the spec's attention over all ``max_length`` positions has it: a call that
    attends over the filled positions only must know the rest finite (docs:
    "Generating with a cache")."""
    config, weights, inputs, _ = setup("gqa_bias", 5)
    layer = layer_of(runner, weights, config)
    max_length = 2 * spec.SPAN_BUCKET + 8
    cache = prefilled(runner, layer, inputs, np.array([3, 2, 1]), max_length)
    before = cache_as_numpy(runner, cache)
    values = before.values.copy()
    values[0, 0, spec.SPAN_BUCKET + 5, 1] = np.nan  # past any span a step rounds to
    values[2, -1, 4, 0] = np.inf  # past every example's filled positions after the step
    given = spec.KVCache(cache.keys, runner.to_native(values), cache.lengths)
    rows = [x[:, 3:4] for x in inputs.values()]
    output, _ = runner.forward(layer, *native(runner, rows), causal=True, cache=given)
    expected, _, _ = spec.reference_cached_forward(
        weights,
        *rows,
        spec.KVCache(before.keys, values, before.lengths),
        **reference_heads(config),
        causal=True,
    )
    assert np.isnan(expected[[0, 2]]).all() and np.isfinite(expected[1]).all()
    got = runner.to_numpy(output)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_allclose(got[1], expected[1], atol=5e-6, rtol=0)


def test_a_call_without_keys_attends_to_the_cache_as_it_is(runner):
    config, weights, inputs, _ = setup("gqa_bias", 4)
    layer = layer_of(runner, weights, config)
    cache = prefilled(runner, layer, inputs, np.array([3, 2, 1]), 5)
    before = cache_as_numpy(runner, cache)
    queries = inputs["queries"][:, 3:5]
    output, attention_weights, after = runner.forward(
        layer,
        runner.to_native(queries),
        None,
        None,
        None,
        causal=True,
        cache=cache,
        return_attention_weights=True,
    )
    expected, expected_weights, _ = spec.reference_cached_forward(
        weights, queries, None, None, before, **reference_heads(config), causal=True
    )
    np.testing.assert_allclose(runner.to_numpy(output), expected, atol=5e-6, rtol=0)
    np.testing.assert_allclose(
        runner.to_numpy(attention_weights), expected_weights, atol=5e-6, rtol=0
    )
    assert np.asarray(runner.to_numpy(after.lengths)).tolist() == [3, 2, 1]
    # The default call (a fused path where there is one) gives the same output.
    output, after = runner.forward(
        layer, runner.to_native(queries), None, None, None, causal=True, cache=cache
    )
    np.testing.assert_allclose(runner.to_numpy(output), expected, atol=5e-6, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch, length", [(0, 3), (3, 0)], ids=["no examples", "no positions"])
def test_cached_calls_with_an_empty_axis(runner, batch, length, causal):
    """A cached call of an empty batch, or of no new positions, twice: the reference's
    empty output, and a cache of the same shapes whose lengths grow by the positions."""
    config, weights, inputs, _ = setup("gqa_bias", 7, batch=batch, length=length)
    layer = layer_of(runner, weights, config)
    cache = runner.init_cache(layer, batch, 8)
    for call in range(2):
        before = cache_as_numpy(runner, cache)
        output, cache = runner.forward(
            layer,
            *(runner.to_native(inputs[name]) for name in ("queries", "keys", "values")),
            None,
            causal=causal,
            cache=cache,
        )
        expected, _, _ = spec.reference_cached_forward(
            weights,
            inputs["queries"],
            inputs["keys"],
            inputs["values"],
            before,
            **reference_heads(config),
            causal=causal,
        )
        output = runner.to_numpy(output)
        assert output.shape == expected.shape == (batch, length, config["num_hiddens"])
        after = cache_as_numpy(runner, cache)
        assert after.keys.shape == (batch, 2, 8, 4)
        assert np.asarray(after.lengths).tolist() == [length * (call + 1)] * batch


def test_cache_lengths_are_int32_or_int64(runner):
    """int64 lengths (numpy's integers) count a cache's positions as init_cache's int32
    do: the reference's output and lengths. Narrower integers would wrap around before
    they count its positions (uint8's 255), unsigned ones mix with no framework's
    positions alike: refused with one TypeError everywhere, before anything is written."""
    config, weights, inputs, _ = setup("gqa_bias", 3)
    layer = layer_of(runner, weights, config)
    cache = prefilled(runner, layer, inputs, np.array([3, 2, 1]), 6)
    before = cache_as_numpy(runner, cache)
    rows = [x[:, 3:5] for x in inputs.values()]
    for dtype in ("int8", "uint8"):
        given = spec.KVCache(
            cache.keys, cache.values, runner.native_lens(before.lengths.astype(dtype))
        )
        with pytest.raises(
            TypeError, match=f"cache.lengths must be int32 or int64 .*; got {dtype}"
        ):
            runner.forward(layer, *native(runner, rows), causal=True, cache=given)
    np.testing.assert_array_equal(cache_as_numpy(runner, cache).keys, before.keys)
    given = spec.KVCache(
        cache.keys, cache.values, runner.native_lens(before.lengths.astype("int64"))
    )
    output, after = runner.forward(layer, *native(runner, rows), causal=True, cache=given)
    expected, _, _ = spec.reference_cached_forward(
        weights, *rows, before, **reference_heads(config), causal=True
    )
    np.testing.assert_allclose(runner.to_numpy(output), expected, atol=5e-6, rtol=0)
    assert np.asarray(runner.to_numpy(after.lengths)).tolist() == [5, 4, 3]


def test_a_cache_whose_keys_and_values_are_one_array(runner):
    """One array given as both the keys and the values of a cache (its rows would be
    written over each other in place) is read as the two the spec's update makes of it:
    a prefill and two steps give the reference's outputs, and the given array is left
    as it was."""
    config, weights, inputs, _ = setup("gqa_bias", 6)
    layer = layer_of(runner, weights, config)
    made = runner.init_cache(layer, 3, 8)
    cache = spec.KVCache(made.keys, made.keys, made.lengths)
    held = cache_as_numpy(runner, cache)
    for start, stop, new_lens in ((0, 3, np.array([3, 2, 1])), (3, 4, None), (4, 5, None)):
        rows = [x[:, start:stop] for x in inputs.values()]
        before = cache_as_numpy(runner, cache)
        output, cache = runner.forward(
            layer, *native(runner, rows, new_lens), causal=True, cache=cache
        )
        expected, _, _ = spec.reference_cached_forward(
            weights, *rows, before, new_lens, **reference_heads(config), causal=True
        )
        np.testing.assert_allclose(runner.to_numpy(output), expected, atol=5e-6, rtol=0)
    assert np.asarray(runner.to_numpy(cache.lengths)).tolist() == [5, 4, 3]
    np.testing.assert_array_equal(runner.to_numpy(made.keys), held.keys)


def test_init_cache_is_empty_and_of_the_layers_dtype(runner):
    config, weights, _, _ = setup("gqa_bias", 0)
    for dtype in ("float32", "float64"):
        if not runner.dtype_supported("cpu", dtype):
            continue
        cache = runner.init_cache(layer_of(runner, weights, config, dtype), 2, 5)
        assert isinstance(cache, spec.KVCache)
        keys, values = runner.to_numpy(cache.keys), runner.to_numpy(cache.values)
        assert keys.shape == values.shape == (2, 2, 5, 4)
        assert not keys.any() and not values.any()
        assert np.asarray(runner.to_numpy(cache.lengths)).tolist() == [0, 0]
        # The cache's dtype is the layer's.
        assert dtype in str(cache.keys.dtype) and dtype in str(cache.values.dtype)
        assert "int32" in str(cache.lengths.dtype)


def test_init_cache_refuses_a_dtype_that_is_not_floating(runner):
    """An integer cache is refused where it is made, with the same message everywhere
    (a call would refuse it later, as of another dtype than the projections')."""
    config, weights, _, _ = setup("gqa_bias", 0)
    layer = layer_of(runner, weights, config)
    layer = getattr(layer, "module", layer)  # (Linen's module, beside its variables)
    integer = runner.native_lens(np.array([1])).dtype  # (the framework's own integer dtype)
    message = "init_cache's dtype must be a floating dtype of the layer's framework or None"
    with pytest.raises(TypeError, match=re.escape(message)):
        layer.init_cache(2, 5, dtype=integer)


@pytest.mark.parametrize(
    ("key_length", "with_values", "new_lens", "max_length", "error", "match"),
    [
        (3, True, [2, 3, 1], 2, ValueError, "overflows"),
        (3, True, [4, 0, 0], 8, ValueError, r"in \[0, 3\]"),
        (3, True, [-1, 0, 0], 8, ValueError, r"in \[0, 3\]"),
        (2, True, None, 8, ValueError, "length 3"),
        (3, True, [[1, 1, 1]] * 3, 8, ValueError, r"shape \(batch,\)"),
        (3, True, [1.0, 1.0, 1.0], 8, TypeError, "integers"),
        (3, False, None, 8, ValueError, "both"),
        (None, False, [1, 1, 1], 8, ValueError, "valid_lens=None"),
    ],
)
def test_bad_cached_calls_raise_naming_the_argument(
    runner, key_length, with_values, new_lens, max_length, error, match
):
    config, weights, inputs, _ = setup("gqa_bias", 0)
    layer = layer_of(runner, weights, config)
    queries = runner.to_native(inputs["queries"][:, :3])
    keys = values = None
    if key_length is not None:
        keys = runner.to_native(inputs["keys"][:, :key_length])
        if with_values:
            values = runner.to_native(inputs["values"][:, :key_length])
    lens = None if new_lens is None else runner.native_lens(np.asarray(new_lens))
    cache = runner.init_cache(layer, 3, max_length)
    with pytest.raises(error, match=match):
        runner.forward(layer, queries, keys, values, lens, causal=True, cache=cache)


def test_a_cache_is_any_tuple_of_its_three_arrays(runner):
    """A cache handed on as a plain tuple is the cache (the same output and lengths); a
    list, or a tuple of two, is refused with the same message in every backend."""
    config, weights, inputs, _ = setup("gqa_bias", 0)
    layer = layer_of(runner, weights, config)
    rows = [runner.to_native(inputs[name][:, :2]) for name in ("queries", "keys", "values")]
    outputs = []
    for given in (lambda cache: cache, tuple):
        output, cache = runner.call_as_given(
            layer, *rows, causal=True, cache=given(runner.init_cache(layer, 3, 4))
        )
        assert isinstance(cache, spec.KVCache)
        assert np.asarray(runner.to_numpy(cache.lengths)).tolist() == [2, 2, 2]
        outputs.append(runner.to_numpy(output))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    for wrong, name in ((list, "list"), (lambda cache: tuple(cache)[:2], "tuple")):
        message = (
            r"cache must be a KVCache\(keys, values, lengths\), as the layer's init_cache "
            f"makes it; got {name}"
        )
        with pytest.raises(TypeError, match=message):
            runner.call_as_given(
                layer, *rows, causal=True, cache=wrong(runner.init_cache(layer, 3, 4))
            )


def test_a_cache_of_another_layout_is_rejected(runner):
    config, weights, inputs, _ = setup("gqa_bias", 0)
    layer = layer_of(runner, weights, config)
    other = layer_of(runner, setup("mha", 0)[1], {**CONFIGS["mha"], "num_heads": 4})
    rows = [runner.to_native(inputs[name][:, :2]) for name in ("queries", "keys", "values")]
    for cache, match in (
        (runner.init_cache(other, 3, 4), "cache.keys must have shape"),
        (runner.init_cache(layer, 2, 4), "cache.keys must have shape"),
    ):
        with pytest.raises(ValueError, match=match):
            runner.forward(layer, *rows, None, causal=True, cache=cache)


def finite_difference_gradients(function, arrays, output_gradient, step=1e-6):
    """Central differences of ``sum(function(arrays) * output_gradient)``, float64."""
    grads = {}
    for name, array in arrays.items():
        grad = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            values = []
            for sign in (1, -1):
                shifted = {k: v.copy() for k, v in arrays.items()}
                shifted[name][index] += sign * step
                values.append(np.sum(function(shifted) * output_gradient))
            grad[index] = (values[0] - values[1]) / (2 * step)
        grads[name] = grad
    return grads


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "uniform"])
def test_gradients_through_a_cached_call(runner, ragged):
    """Inputs and weights of a second call, with the first call's cache held fixed: of
    examples at different lengths, and at one (an eager call's write of one slice; on
    Keras' TensorFlow backend, TensorFlow's slice update had no gradient)."""
    dtype = "float64" if runner.dtype_supported("cpu", "float64") else "float32"
    config, weights, inputs, rng = setup("gqa_bias", 5, batch=2, length=4)
    layer = layer_of(runner, weights, config, dtype)
    cache = runner.init_cache(layer, 2, 6)
    first = [runner.to_native(x[:, :2], dtype=dtype) for x in inputs.values()]
    new_lens = np.array([2, 1]) if ragged else None
    lens = None if new_lens is None else runner.native_lens(new_lens)
    _, cache = runner.forward(layer, *first, lens, causal=True, cache=cache)
    held = cache_as_numpy(runner, cache)
    rows = {name: x[:, 2:4].astype(np.float64) for name, x in inputs.items()}
    output_gradient = rng.standard_normal((2, 2, config["num_hiddens"]))
    grads = runner.vjp(
        layer,
        *(runner.to_native(x, dtype=dtype) for x in rows.values()),
        lens,
        causal=True,
        output_gradient=runner.to_native(output_gradient, dtype=dtype),
        cache=cache,
    )

    def cached_output(arrays):
        chosen = {k: arrays.get(k, v) for k, v in weights.items()}
        return spec.reference_cached_forward(
            chosen,
            arrays["queries"],
            arrays["keys"],
            arrays["values"],
            held,
            new_lens,
            **reference_heads(config),
            causal=True,
        )[0]

    arrays = {**rows, **{k: v.astype(np.float64) for k, v in weights.items()}}
    expected = finite_difference_gradients(cached_output, arrays, output_gradient)
    atol = 1e-7 if dtype == "float64" else 5e-5
    assert set(grads) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(
            runner.to_numpy(grads[name]), value, atol=atol, rtol=0, err_msg=name
        )
    if ragged:  # the padding position of example 1 reaches nothing
        assert not np.any(runner.to_numpy(grads["keys"])[1, 1])
