"""Randomised configurations against the float64 reference, in every backend."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mha_multi import spec
from mha_multi.weights import init_weights

#: The settings of every test here. The example count comes from the hypothesis
#: profile (conftest.py): a few dozen in the default run, many more in the
#: opt-in ``exhaustive`` session.
RANDOMISED = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


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


@RANDOMISED
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


# -- heads, options and caches ------------------------------------------------------


@st.composite
def layers(draw):
    """A layer's heads (grouped or not) and options (docs: "Positions and biases")."""
    num_kv_heads = draw(st.integers(1, 3))
    num_heads = num_kv_heads * draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([2, 4, 6]))
    # Self-attention: one array as queries, keys and values, and with no options a
    # plain call, which a backend may answer by a route of its own (docs: "Fast paths").
    self_attention = draw(st.booleans())
    options = {}
    if not (self_attention and draw(st.booleans())):  # (else a layer of no options)
        if draw(st.booleans()):
            options["rotary"] = {
                "theta": draw(st.sampled_from([10.0, 10000.0])),
                "fraction": draw(st.sampled_from([1.0, 0.5])) if head_dim == 4 else 1.0,
                "interleaved": draw(st.booleans()),
            }
        if draw(st.booleans()):
            options["alibi"] = True
        if draw(st.booleans()):
            options["window"] = draw(st.integers(1, 4))
        if draw(st.booleans()):
            options["softcap"] = draw(st.sampled_from([0.5, 5.0]))
    if self_attention:
        sizes = [draw(st.integers(1, 5))] * 3
    elif "rotary" in options:  # (queries and keys of one sequence's positions)
        sizes = [draw(st.integers(1, 5))] * 2 + [draw(st.integers(1, 5))]
    else:
        sizes = [draw(st.integers(1, 5)) for _ in range(3)]
    return {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "num_hiddens": num_heads * head_dim,
        "self_attention": self_attention,
        "sizes": sizes,
        "bias": draw(st.booleans()),
        "options": options,
    }


def built(runner, layer: dict, seed: int):
    """The canonical weights of ``layer`` (a :func:`layers` draw) and the backend's layer."""
    query_size, key_size, value_size = layer["sizes"]
    sizes = {"query_size": query_size, "key_size": key_size, "value_size": value_size}
    heads = {"num_heads": layer["num_heads"], "num_kv_heads": layer["num_kv_heads"]}
    weights = init_weights(layer["num_hiddens"], bias=layer["bias"], seed=seed, **heads, **sizes)
    made = runner.make_layer(
        layer["num_hiddens"],
        layer["num_heads"],
        num_kv_heads=layer["num_kv_heads"],
        bias=layer["bias"],
        **sizes,
        **layer["options"],
    )
    return weights, runner.set_weights(made, weights), {**heads, **layer["options"]}


def call_arguments(runner, rng, extras, layer: dict, sizes: tuple[int, int, int]):
    """The call's ``bias``, ``head_mask`` and (a rotary layer's) ``positions`` named in
    ``extras``, for ``sizes`` ``(B, Q, K)`` (``K``: a cache's ``max_length``): as numpy
    for the reference, and as the backend's arrays."""
    batch, num_queries, num_keys = sizes
    call = {}
    if "bias" in extras:
        call["bias"] = rng.standard_normal((1, layer["num_heads"], num_queries, num_keys))
    if "head_mask" in extras:
        call["head_mask"] = rng.random(layer["num_heads"])
    if "positions" in extras and "rotary" in layer["options"]:
        call["positions"] = rng.integers(0, 20, size=(batch, num_queries))
    call = {
        name: np.asarray(x, np.int64 if name == "positions" else np.float32)
        for name, x in call.items()
    }
    native = {
        name: runner.native_lens(x) if name == "positions" else runner.to_native(x)
        for name, x in call.items()
    }
    return call, native


def assert_as_reference(got, expected, what):
    """The reference's NaN pattern, and its finite numbers within float32's error."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected), err_msg=what)
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-5, atol=2e-5, err_msg=what)


@RANDOMISED
@given(
    layer=layers(),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5)),
    lens_kind=st.sampled_from(["none", "1d", "2d"]),
    causal=st.booleans(),
    extras=st.sets(st.sampled_from(["bias", "head_mask", "positions", "nan"])),
    seed=st.integers(0, 2**16),
)
def test_random_heads_options_and_call_arguments_match_reference(
    runner, layer, shape, lens_kind, causal, extras, seed
):
    """Grouped heads, every layer option and call argument: the output, the weights
    and (for finite inputs) every gradient, against the float64 reference."""
    rng = np.random.default_rng(seed)
    weights, made, reference = built(runner, layer, seed)
    batch, num_queries, num_keys = shape
    if layer["self_attention"] or ("rotary" in layer["options"] and "positions" in extras):
        num_keys = num_queries  # (positions serve the queries and the keys)
    query_size, key_size, value_size = layer["sizes"]
    inputs = [
        rng.standard_normal((batch, n, size)).astype(np.float32)
        for n, size in ((num_queries, query_size), (num_keys, key_size), (num_keys, value_size))
    ]
    if layer["self_attention"]:
        inputs = [inputs[0]] * 3
    if "nan" in extras:
        which = inputs[rng.integers(3)]
        which[tuple(rng.integers(s) for s in which.shape)] = np.nan
    lens = None
    if lens_kind != "none":
        lens_shape = (batch,) if lens_kind == "1d" else (batch, num_queries)
        lens = rng.integers(-1, num_keys + 2, size=lens_shape)
    call, native = call_arguments(runner, rng, extras, layer, (batch, num_queries, num_keys))
    expected, expected_weights = spec.reference_forward(
        weights, *inputs, lens, causal=causal, **call, **reference
    )
    arrays = [runner.to_native(x) for x in inputs]
    if layer["self_attention"]:
        arrays = [arrays[0]] * 3
    output = runner.forward(made, *arrays, runner.native_lens(lens), causal=causal, **native)
    assert_as_reference(runner.to_numpy(output), expected, "output")
    output, attention = runner.forward(
        made,
        *arrays,
        runner.native_lens(lens),
        causal=causal,
        return_attention_weights=True,
        **native,
    )
    assert_as_reference(runner.to_numpy(output), expected, "output with the weights")
    assert_as_reference(runner.to_numpy(attention), expected_weights, "weights")
    if "nan" in extras:
        return
    cotangent = rng.standard_normal(expected.shape).astype(np.float32)
    expected = spec.reference_gradients(
        weights, *inputs, lens, causal=causal, output_gradient=cotangent, **call, **reference
    )
    got = runner.gradients(
        made,
        *inputs,
        lens,
        causal=causal,
        output_gradient=cotangent,
        device="cpu",
        dtype="float32",
        **call,
    )
    for name, gradient in expected.items():
        assert_as_reference(got[name], gradient, f"gradient of {name}")


@RANDOMISED
@given(
    layer=layers(),
    batch=st.integers(1, 3),
    max_length=st.integers(3, 10),
    calls=st.lists(
        st.tuples(
            st.sampled_from([1, 1, 2, 3]),  # new positions
            st.sampled_from(["all", "all", "ragged", "none"]),  # what each example appends
            st.booleans(),  # causal
            st.sets(st.sampled_from(["bias", "head_mask", "positions", "older"]), max_size=2),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_random_cached_calls_match_reference(runner, layer, batch, max_length, calls, seed):
    """Sequences of cached calls (ragged, appending nothing, with the call's options,
    and older caches called again) against the float64 cached reference, which is
    given what the cache's arrays hold before each call: the outputs at the real
    positions, the lengths, and the filled positions of the cache."""
    rng = np.random.default_rng(seed)
    weights, made, reference = built(runner, layer, seed)
    query_size, key_size, value_size = layer["sizes"]
    cache = runner.init_cache(made, batch, max_length)
    history = [cache]
    for width, appends, causal, extras in calls:
        if "older" in extras:
            cache = history[rng.integers(len(history))]
        held = spec.KVCache(*(runner.to_numpy(x) for x in cache))
        filled = held.lengths.astype(np.int64)
        room = max_length - filled
        if appends == "none":
            if filled.min() < 1:
                continue  # (a query that sees no key: padding, and free)
            new, lens, keys, values = np.zeros(batch, np.int64), None, None, None
        else:
            new = np.minimum(rng.integers(0, width + 1, size=batch), room)
            if appends == "all":
                if room.min() < width:
                    continue
                new = np.full(batch, width)
            lens = None if appends == "all" else new
            keys = rng.standard_normal((batch, width, key_size)).astype(np.float32)
            values = rng.standard_normal((batch, width, value_size)).astype(np.float32)
        queries = rng.standard_normal((batch, width, query_size)).astype(np.float32)
        if layer["self_attention"] and keys is not None:
            keys = values = queries
        call, native = call_arguments(runner, rng, extras, layer, (batch, width, max_length))
        expected, _, after = spec.reference_cached_forward(
            weights, queries, keys, values, held, lens, causal=causal, **call, **reference
        )
        arrays = [None if x is None else runner.to_native(x) for x in (queries, keys, values)]
        if keys is queries:
            arrays = [arrays[0]] * 3
        result = runner.forward(
            made, *arrays, runner.native_lens(lens), cache=cache, causal=causal, **native
        )
        output, cache = result[0], result[-1]
        history.append(cache)
        # Padding queries' rows are free; with nothing appended every query is real.
        counted = new if appends != "none" else np.full(batch, width)
        real = np.arange(width)[None, :] < counted[:, None]
        assert_as_reference(runner.to_numpy(output)[real], expected[real], "output")
        got = [runner.to_numpy(x) for x in cache]
        np.testing.assert_array_equal(got[2], after.lengths)
        kept = np.arange(max_length)[None, None, :, None] < after.lengths[:, None, None, None]
        for name, array, want in zip(("keys", "values"), got, after, strict=False):
            assert_as_reference(np.where(kept, array, 0), np.where(kept, want, 0), name)
