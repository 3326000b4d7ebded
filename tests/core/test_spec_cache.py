"""The cached semantics of the spec against one full causal forward and a per-query loop."""

from __future__ import annotations

import numpy as np
import pytest

from mha_multi import spec
from mha_multi.parity.decode import (
    chunk_rows,
    decode,
    full_reference,
    random_schedule,
    reference_decode,
)
from mha_multi.weights import init_weights

CONFIGS = {
    "mha": {"num_hiddens": 8, "num_heads": 2},
    "gqa_bias": {"num_hiddens": 16, "num_heads": 4, "num_kv_heads": 2, "bias": True},
    "mqa_head_dim": {"num_hiddens": 6, "num_heads": 4, "num_kv_heads": 1, "head_dim": 3},
}


def _setup(name: str, seed: int, batch: int = 3, length: int = 7):
    config = dict(CONFIGS[name])
    bias = config.pop("bias", False)
    num_hiddens = config.pop("num_hiddens")
    weights = init_weights(num_hiddens, bias=bias, seed=seed, query_size=5, **config)
    rng = np.random.default_rng(seed)
    sizes = {"queries": 5, "keys": num_hiddens, "values": num_hiddens}
    inputs = {k: rng.standard_normal((batch, length, size)) for k, size in sizes.items()}
    lengths = rng.integers(0, length + 1, size=batch)
    heads = {k: v for k, v in config.items() if k != "head_dim"}
    return weights, inputs, lengths, heads, rng


def cached_attention(
    heads: spec.Heads, cache, q, k, v, new_lens, *, causal: bool, options=spec.NO_OPTIONS
):
    """The core of a cached call, on projected inputs: ``k`` and ``v`` written
    into ``cache`` (nothing where ``None``), then ``q`` attending over what it
    holds. Returns ``(context, attention_weights, cache)``."""
    ops = spec.NumpyOps()
    cache, lens = spec.update_cache(
        ops, cache, k, v, new_lens, head_dim=heads.head_dim, causal=causal
    )
    context, attention_weights = spec.attention(
        ops,
        q,
        cache.keys,
        cache.values,
        lens,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
        kv_split=True,
        options=options,
    )
    return context, attention_weights, cache


def _spec_step(weights, heads: spec.Heads, causal: bool):
    """A cached call written with the spec's functions, as every backend writes it."""

    def linear(x, name):
        y = x @ weights[f"W_{name}"]
        return y + weights[f"b_{name}"] if f"b_{name}" in weights else y

    def step(queries, keys, values, cache, new_lens):
        k = None if keys is None else linear(keys, "k")
        v = None if values is None else linear(values, "v")
        context, attention_weights, cache = cached_attention(
            heads, cache, linear(queries, "q"), k, v, new_lens, causal=causal
        )
        return linear(context, "o"), attention_weights, cache

    return step


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_any_schedule_equals_one_full_causal_forward(name, seed):
    weights, inputs, lengths, heads, rng = _setup(name, seed)
    chunks = random_schedule(rng, lengths)
    expected = full_reference(weights, inputs, lengths, **heads)
    actual = reference_decode(weights, inputs, lengths, chunks, **heads, max_length=9)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_update_cache_and_attention_are_the_per_query_loop(name, seed, causal):
    weights, inputs, _, heads, rng = _setup(name, seed)
    layout = spec.heads_of_weights(
        weights, heads["num_heads"], num_kv_heads=heads.get("num_kv_heads")
    )
    shape = spec.cache_shape(3, 10, layout)
    # A cache holding other numbers past its lengths: they must stay hidden.
    cache = spec.KVCache(
        rng.standard_normal(shape), rng.standard_normal(shape), np.array([0, 2, 5], np.int32)
    )
    step = _spec_step(weights, layout, causal)
    for num_new in (4, 1, 0):
        new = np.minimum(rng.integers(0, num_new + 1, size=3), 10 - cache.lengths)
        rows = [chunk_rows(inputs[k], cache.lengths.astype(np.int64), num_new) for k in inputs]
        output, attention_weights, updated = step(*rows, cache, new)
        expected, expected_weights, expected_cache = spec.reference_cached_forward(
            weights, *rows, cache, new, **heads, causal=causal
        )
        np.testing.assert_allclose(output, expected, rtol=0, atol=1e-12)
        np.testing.assert_allclose(attention_weights, expected_weights, rtol=0, atol=1e-12)
        for actual, wanted in zip(updated, expected_cache, strict=True):
            np.testing.assert_array_equal(actual, wanted)
        # The weights are zero on every hidden key, but in a row that sees no
        # key at all (an empty example): it has uniform weights.
        held = (cache.lengths + new)[:, None, None, None]
        hidden = np.broadcast_to((np.arange(10) >= held) & (held > 0), expected_weights.shape)
        assert not attention_weights[hidden].any()
        cache = updated


def test_a_call_without_keys_attends_to_the_cache_and_appends_nothing():
    weights, inputs, _, _, rng = _setup("gqa_bias", 0)
    layout = spec.heads_of_weights(weights, 4)
    shape = spec.cache_shape(3, 6, layout)
    cache = spec.KVCache(
        rng.standard_normal(shape), rng.standard_normal(shape), np.array([1, 6, 3])
    )
    queries = inputs["queries"][:, :2]
    output, attention_weights, updated = _spec_step(weights, layout, True)(
        queries, None, None, cache, None
    )
    expected, expected_weights, expected_cache = spec.reference_cached_forward(
        weights, queries, None, None, cache, num_heads=4, causal=True
    )
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(attention_weights, expected_weights, rtol=0, atol=1e-12)
    assert updated is cache
    np.testing.assert_array_equal(expected_cache.lengths, [1, 6, 3])
    # Every query sees the whole of what its example holds, and nothing else.
    seen = (attention_weights > 0).sum(axis=-1)
    np.testing.assert_array_equal(
        seen, np.broadcast_to(np.array([1, 6, 3])[:, None, None], seen.shape)
    )


def test_writes_that_do_not_fit_are_dropped_and_never_overwrite():
    """What compiled code does where an eager call raises (docs: "Generating with a cache")."""
    ops = spec.NumpyOps()
    heads = spec.Heads(2, 2, 1)
    kept = np.arange(8.0).reshape(1, 2, 4, 1)
    cache = spec.KVCache(kept, -kept, np.array([3]))
    new = np.full((1, 3, 2), 100.0)  # three new positions; one fits
    updated, lens = spec.update_cache(ops, cache, new, -new, None, head_dim=1, causal=True)
    np.testing.assert_array_equal(updated.keys[0, :, :3], kept[0, :, :3])
    np.testing.assert_array_equal(updated.keys[0, :, 3, 0], [100.0, 100.0])
    np.testing.assert_array_equal(updated.values[0, :, 3, 0], [-100.0, -100.0])
    assert updated.lengths.tolist() == [6]  # still counts them: lengths > max_length tells
    np.testing.assert_array_equal(lens, [[4, 5, 6]])
    with pytest.raises(ValueError, match="overflows: example 0 would hold 6"):
        spec.check_cache_values(cache.lengths, None, 3, 4)
    assert heads.group_size == 1


def test_new_lengths_outside_the_call_are_clipped_where_unchecked():
    ops = spec.NumpyOps()
    cache = spec.KVCache(np.zeros((2, 1, 5, 1)), np.zeros((2, 1, 5, 1)), np.array([1, 1]))
    new = np.ones((2, 2, 1))
    updated, _ = spec.update_cache(
        ops, cache, new, new, np.array([7, -3]), head_dim=1, causal=False
    )
    assert updated.lengths.tolist() == [3, 1]
    np.testing.assert_array_equal(updated.keys[:, 0, :, 0], [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]])


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((2, 3, 4), (2, 3, 4), None, None), "keys and values must both be given"),
        (((2, 3, 4), (2, 2, 4), (2, 2, 4), None), "must have their length 3"),
        (((2, 3, 4), (2, 3, 4), (2, 3, 4), (2, 3)), r"must have shape \(batch,\) = \(2,\)"),
        # (not the shapes of a call without a cache, whose valid_lens may be (B, Q))
        (((2, 3, 4), (2, 3, 4), (2, 3, 4), ()), r"of a cached call must have shape \(batch,\)"),
        (((2, 3, 4), (2, 3, 4), (2, 3, 4), (2, 3, 1)), r"cached call must have shape \(batch,\)"),
        (((2, 3, 4), None, None, (2,)), "pass valid_lens=None"),
        (((2, 3, 5), None, None, None), "query_size=4"),
    ],
)
def test_cached_call_shape_errors_name_the_argument(shapes, match):
    heads = spec.Heads(2, 1, 2)
    cache = spec.KVCache((2, 1, 6, 2), (2, 1, 6, 2), (2,))
    with pytest.raises(ValueError, match=match):
        spec.check_cached_inputs(*shapes, cache, heads=heads, query_size=4)


@pytest.mark.parametrize(
    ("cache", "match"),
    [
        (
            ((2, 2, 6, 2), (2, 2, 6, 2), (2,)),
            r"cache.keys must have shape .* \(2, 1, max_length, 2\)",
        ),
        (((2, 1, 6, 2), (2, 1, 5, 2), (2,)), "cache.values must have the shape of cache.keys"),
        (((3, 1, 6, 2), (3, 1, 6, 2), (3,)), "cache.keys"),
        (((2, 1, 6, 2), (2, 1, 6, 2), (2, 1)), r"cache.lengths must have shape \(batch,\)"),
    ],
)
def test_cache_shape_errors_name_the_entry(cache, match):
    with pytest.raises(ValueError, match=match):
        spec.check_cached_inputs(
            (2, 3, 4), (2, 3, 4), (2, 3, 4), None, spec.KVCache(*cache), heads=spec.Heads(2, 1, 2)
        )


def test_cache_value_and_type_errors():
    with pytest.raises(ValueError, match=r"cache.lengths must be >= 0"):
        spec.check_cache_values(np.array([0, -1]), None, 2, 8)
    with pytest.raises(ValueError, match=r"must be in \[0, 2\]"):
        spec.check_cache_values(np.array([0, 1]), np.array([3, 0]), 2, 8)
    spec.check_cache_values(np.array([6, 0]), np.array([2, 0]), 2, 8)  # exactly full
    with pytest.raises(TypeError, match="cache.lengths must be integers"):
        spec.check_cache_dtypes("f", None)
    with pytest.raises(TypeError, match="valid_lens of a cached call .* integers"):
        spec.check_cache_dtypes("i", "f")
    for kind, itemsize, name in (("i", 1, "int8"), ("i", 2, "int16"), ("u", 4, "uint32")):
        with pytest.raises(TypeError, match=f"must be int32 or int64 .*; got {name}$"):
            spec.check_cache_dtypes(kind, "i", itemsize)
    spec.check_cache_dtypes("i", "u", 8)  # int64 lengths, unsigned new lengths
    with pytest.raises(TypeError, match="max_length"):
        spec.cache_shape(2, 3.0, spec.Heads(1, 1, 1))
    with pytest.raises(ValueError, match="batch_size"):
        spec.cache_shape(-1, 3, spec.Heads(1, 1, 1))
    with pytest.raises(TypeError, match="cache.keys dtype"):
        spec.update_cache(
            spec.NumpyOps(),
            spec.KVCache(
                np.zeros((1, 1, 2, 1), np.float32), np.zeros((1, 1, 2, 1)), np.zeros(1, int)
            ),
            np.zeros((1, 1, 1)),
            np.zeros((1, 1, 1)),
            None,
            head_dim=1,
            causal=False,
        )


@pytest.mark.parametrize(
    ("lens", "error", "match"),
    [
        (np.array([1.0, 2.0]), TypeError, "valid_lens of a cached call .* must be integers"),
        (np.ones((2, 3), np.int64), ValueError, r"must have shape \(batch,\) = \(2,\)"),
    ],
)
def test_the_reference_cached_call_checks_its_lengths_as_the_layers_do(lens, error, match):
    """The reference's cached call checks what every layer checks (its numpy indexing
    raised ``slice indices must be integers`` and the like)."""
    weights = init_weights(8, num_heads=2, seed=0)
    cache = spec.KVCache(np.zeros((2, 2, 6, 4)), np.zeros((2, 2, 6, 4)), np.zeros(2, np.int32))
    x = np.ones((2, 3, 8))
    with pytest.raises(error, match=match):
        spec.reference_cached_forward(weights, x, x, x, cache, lens, num_heads=2)
    *_, updated = spec.reference_cached_forward(
        weights, x, x, x, cache, np.array([1, 2]), num_heads=2
    )
    assert updated.lengths.tolist() == [1, 2]


@pytest.mark.parametrize("causal", [True, False])
def test_the_host_visibility_of_a_fill_is_the_cached_visibility(causal):
    fill = spec.check_cache_values(np.array([3, 1, 0]), np.array([2, 0, 3]), 3, 8)
    _, lens = spec.update_cache(
        spec.NumpyOps(),
        spec.KVCache(np.zeros((3, 1, 8, 1)), np.zeros((3, 1, 8, 1)), np.array([3, 1, 0])),
        np.ones((3, 3, 1)),
        np.ones((3, 3, 1)),
        np.array([2, 0, 3]),
        head_dim=1,
        causal=causal,
    )
    np.testing.assert_array_equal(fill.visibility(3, causal=causal), lens)
    if causal:  # query i sees lengths + min(new, i + 1)
        np.testing.assert_array_equal(lens, [[4, 5, 5], [1, 1, 1], [1, 2, 3]])


@pytest.mark.parametrize(
    ("lengths", "new", "window", "span"),
    [
        ([3, 1, 0], [1, 1, 1], None, 4),  # held 4, 2, 1: one bucket of 4
        ([5, 1], [1, 1], None, 8),  # held 6: rounded up to 8
        ([15, 1], [1, 1], None, 16),  # held 16 = max_length
        ([3, 0], [1, 0], None, 16),  # example 1 holds nothing: uniform over all 16
        ([3, 2], [3, 1], 3, 8),  # padding query 2 of example 1: 3 - 1 < 3, sees its key
        ([3, 2], [3, 0], 3, 16),  # padding queries of example 1 see nothing in the window
    ],
)
def test_the_span_attended_over_covers_every_visible_key(lengths, new, window, span):
    num_new = max(new) if window is None else 3
    fill = spec.check_cache_values(np.array(lengths), np.array(new), num_new, 16)
    assert fill.span(num_new, 16, window=window, bucket=4) == span


def test_random_schedules_cover_ragged_prefills_and_single_steps():
    rng = np.random.default_rng(0)
    lengths = np.array([5, 0, 7])
    seen_single = seen_partial = 0
    for _ in range(20):
        chunks = random_schedule(rng, lengths)
        assert np.array_equal(np.sum([new for _, new in chunks], axis=0), lengths)
        assert all(0 <= n <= size for size, new in chunks for n in new)
        seen_single += any(size == 1 for size, _ in chunks[1:])
        seen_partial += any(0 < n < size for size, new in chunks for n in new)
    assert seen_single > 10 and seen_partial > 10


def test_decode_rejects_a_schedule_that_misses_positions():
    inputs = {k: np.zeros((1, 3, 2)) for k in ("queries", "keys", "values")}
    with pytest.raises(ValueError, match="appends"):
        decode(lambda q, k, v, n: np.zeros((1, q.shape[1], 2)), inputs, np.array([3]), [(2, [2])])


def test_a_cache_of_no_positions_gives_the_output_bias():
    weights, inputs, _, heads, _ = _setup("gqa_bias", 1)
    layout = spec.heads_of_weights(weights, 4)
    shape = spec.cache_shape(3, 0, layout)
    cache = spec.KVCache(np.zeros(shape), np.zeros(shape), np.zeros(3, np.int32))
    rows = [x[:, :2] for x in inputs.values()]
    output, attention_weights, _ = spec.reference_cached_forward(
        weights, rows[0], None, None, cache, **heads, causal=True
    )
    assert attention_weights.shape == (3, 4, 2, 0)
    np.testing.assert_array_equal(output, np.broadcast_to(weights["b_o"], output.shape))
