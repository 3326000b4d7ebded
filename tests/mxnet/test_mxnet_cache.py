"""What only the MXNet layer's key/value cache has: hybridized graphs, the
exported graph's handling of lengths it cannot refuse, the fast route, and
Gluon's gradients.

The cached behaviour every backend shares (parity cases in every dtype,
random schedules, errors, gradients) is tests/backends/test_cache.py's, for
the imperative and the hybridized layer alike.
"""

from __future__ import annotations

import contextlib
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd
from mxnet_support import (
    HYBRID,
    IMPERATIVE,
    KV_HEADS,
    NUM_HEADS,
    NUM_HIDDENS,
    QUERY_SIZE,
    exported,
    layer_of,
    layout_inputs,
    layout_weights,
    reference_heads,
)

from mha_multi import spec
from mha_multi.mxnet import KVCache, MultiHeadAttention
from mha_multi.mxnet._facts import MXNetFacts
from mha_multi.mxnet._graph import AttentionGraph
from mha_multi.parity.compare import tolerance
from mha_multi.parity.decode import (
    chunk_index,
    chunk_rows,
    full_reference,
    full_reference_gradients,
)
from mha_multi.parity.harness import KernelCall
from mha_multi.parity.harness import mxnet as backend

#: Ragged sequences and their schedule: a padded prefill of 3, steps of 1
#: (with idle examples) and a chunk of 2; example 2 fills the cache.
LENGTHS = np.array([5, 2, 6])
CHUNKS = [(3, [3, 2, 1]), (1, [1, 0, 1]), (2, [1, 0, 2]), (1, [0, 0, 1]), (1, [0, 0, 1])]
MAX_LENGTH = 6


def weights_and_inputs(kind, seed=0):
    return layout_weights(kind, seed), layout_inputs(seed, 3, MAX_LENGTH, MAX_LENGTH, np.float32)


def native(rows, dtype="float32"):
    return [None if x is None else mx.np.array(x, dtype=dtype) for x in rows]


def int32(values):
    return mx.np.array(values, dtype=np.int32)


def projected_heads(weights, x, name, kv_heads):
    """The float64 projection ``x @ W + b`` split into heads ``(B, H_kv, T, dh)``."""
    y = x.astype(np.float64) @ weights[f"W_{name}"] + weights.get(f"b_{name}", 0.0)
    return y.reshape(*y.shape[:2], kv_heads, -1).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("return_attention_weights", [False, True])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", list(KV_HEADS))
def test_hybridized_and_imperative_decoding_give_the_reference(
    kind, dtype, return_attention_weights
):
    weights, inputs = weights_and_inputs(kind)
    options = {"max_length": MAX_LENGTH, "dtype": dtype}
    if return_attention_weights:
        options["return_attention_weights"] = True
    decoded = {
        runner.name: runner.decode(
            layer_of(runner, kind, weights, dtype), inputs, LENGTHS, CHUNKS, **options
        )
        for runner in (IMPERATIVE, HYBRID)
    }
    expected = full_reference(weights, inputs, LENGTHS, **reference_heads(kind))
    for name, output in decoded.items():
        error = np.abs(output - expected).max()
        assert error <= tolerance(dtype, "output"), (name, error)
    # An imperative call that records nothing writes the cache in place and
    # attends over the filled positions only: other shapes than the graph's,
    # the same numbers within rounding.
    error = np.abs(decoded["mxnet-hybrid"] - decoded["mxnet"]).max()
    assert error <= tolerance(dtype, "output"), error


@pytest.mark.parametrize("runner", [IMPERATIVE, HYBRID], ids=lambda runner: runner.name)
def test_calls_recording_nothing_write_the_cache_in_place(runner):
    """The ragged schedule, example 2 filling the cache exactly: every call writes
    into the same arrays, with the reference's numbers; an overflow is refused
    with nothing written; a recorded call leaves the given cache as it was."""
    weights, inputs = weights_and_inputs("gqa")
    layer = layer_of(runner, "gqa", weights)
    cache = first = layer.init_cache(3, MAX_LENGTH)
    consumed = np.zeros(3, np.int64)
    outputs = np.zeros((3, MAX_LENGTH, NUM_HIDDENS))
    for num_new, new_lens in CHUNKS:
        rows = [chunk_rows(x, consumed, num_new) for x in inputs.values()]
        output, cache = layer(*native(rows), int32(new_lens), causal=True, cache=cache)
        assert cache.keys is first.keys and cache.values is first.values
        for b, count in enumerate(new_lens):
            outputs[b, consumed[b] : consumed[b] + count] = output.asnumpy()[b, :count]
        consumed += new_lens
    expected = full_reference(weights, inputs, LENGTHS, **reference_heads("gqa"))
    np.testing.assert_allclose(outputs, expected, rtol=0, atol=tolerance("float32", "output"))
    assert cache.lengths.asnumpy().tolist() == LENGTHS.tolist()

    before = as_numpy(cache)
    rows = native([x[:, :1] for x in inputs.values()])
    with pytest.raises(ValueError, match="overflows: example 2 would hold 7"):
        layer(*rows, int32([0, 0, 1]), causal=True, cache=cache)
    with autograd.record():
        _, updated = layer(*rows, int32([1, 1, 0]), causal=True, cache=cache)
    assert updated.keys is not cache.keys
    for kept, old in zip(as_numpy(cache), before, strict=True):
        np.testing.assert_array_equal(kept, old)


@pytest.mark.parametrize("runner", [IMPERATIVE, HYBRID], ids=lambda runner: runner.name)
def test_gradients_through_recorded_decoding_are_the_full_forwards(runner):
    """The ragged schedule recorded by ``autograd.record()``, each call's cache the next
    one's: every input row's and weight's gradient is that of one full causal
    forward (the float64 reference's, derived by hand), padding rows get none.
    Hybridized too, where each call's graph returned lengths whose gradient
    the next call's backward pass sent into integer operations, which MXNet 1.9
    refuses ("Backward only supports float types")."""
    weights, inputs = weights_and_inputs("gqa")
    layer = layer_of(runner, "gqa", weights, "float64")
    rng = np.random.default_rng(3)
    real = np.arange(MAX_LENGTH) < LENGTHS[:, None]
    output_gradient = np.where(
        real[..., None], rng.standard_normal((3, MAX_LENGTH, NUM_HIDDENS)), 0
    )
    cache = layer.init_cache(3, MAX_LENGTH)
    consumed = np.zeros(3, np.int64)
    chunks = []
    with autograd.record(train_mode=False):
        loss = 0.0
        for num_new, new_lens in CHUNKS:
            rows = native([chunk_rows(x, consumed, num_new) for x in inputs.values()], "float64")
            for row in rows:
                row.attach_grad()
            output, cache = layer(*rows, int32(new_lens), causal=True, cache=cache)
            index = chunk_index(consumed, num_new, MAX_LENGTH)
            kept = np.arange(num_new) < np.asarray(new_lens)[:, None]
            cotangent = np.take_along_axis(output_gradient, index[..., None], axis=1)
            cotangent = np.where(kept[..., None], cotangent, 0.0)
            loss = loss + (output * mx.np.array(cotangent, dtype="float64")).sum()
            chunks.append((rows, index, kept))
            consumed += new_lens
    loss.backward()

    expected = full_reference_gradients(
        weights, inputs, LENGTHS, output_gradient, **reference_heads("gqa")
    )
    for position, name in enumerate(inputs):
        gathered = np.zeros_like(expected[name])
        for rows, index, kept in chunks:
            grad = rows[position].grad.asnumpy()
            assert not grad[~kept].any(), name  # (padding rows reach nothing)
            for b, t in zip(*np.nonzero(kept), strict=True):
                gathered[b, index[b, t]] += grad[b, t]
        np.testing.assert_allclose(gathered, expected[name], rtol=0, atol=1e-10, err_msg=name)
    for name in ("W_q", "W_k", "W_v", "W_o"):
        dense = getattr(layer, name)
        np.testing.assert_allclose(
            dense.weight.grad().asnumpy().T, expected[name], rtol=0, atol=1e-10, err_msg=name
        )
        np.testing.assert_allclose(
            dense.bias.grad().asnumpy(), expected[f"b_{name[-1]}"], rtol=0, atol=1e-10
        )


@pytest.mark.parametrize("runner", [IMPERATIVE, HYBRID], ids=lambda runner: runner.name)
def test_uniform_steps_attend_over_the_filled_positions_in_buckets(runner, monkeypatch):
    # A prompt, then steps of one across the buckets' edges: each call, imperative
    # or hybridized, attends over the filled positions rounded up to
    # spec.SPAN_BUCKET (the whole cache past the last bucket), with the
    # reference's numbers.
    spans = []
    prefix = MXNetFacts.cache_prefix

    def spying(facts, keys, values, span):
        spans.append(span)
        return prefix(facts, keys, values, span)

    monkeypatch.setattr(MXNetFacts, "cache_prefix", spying)
    bucket, max_length, prompt = spec.SPAN_BUCKET, 2 * spec.SPAN_BUCKET + 20, 60
    length = max_length - 8  # the last steps attend over the whole cache
    weights = layout_weights("gqa", 1)
    inputs = layout_inputs(1, 2, length, length, np.float32)
    chunks = [(prompt, [prompt, prompt])] + [(1, [1, 1])] * (length - prompt)
    layer = layer_of(runner, "gqa", weights)
    output = runner.decode(layer, inputs, np.array([length, length]), chunks, max_length=max_length)
    expected = full_reference(weights, inputs, np.array([length, length]), **reference_heads("gqa"))
    np.testing.assert_allclose(output, expected, rtol=0, atol=tolerance("float32", "output"))
    rounded = [min(-(-n // bucket) * bucket, max_length) for n in prompt + np.arange(len(chunks))]
    assert spans == [span for span in rounded if span < max_length]
    if runner is HYBRID:
        assert set(spans) == {bucket, 2 * bucket}
        assert len(layer._graphs.by_config) == 2  # the prompt's (B, T) lengths, the steps' (B,)


@pytest.mark.parametrize("runner", [IMPERATIVE, HYBRID], ids=lambda runner: runner.name)
def test_non_finite_inputs_give_the_references_numbers_in_place(runner):
    # A NaN key and an inf value at kept positions, an inf value at a
    # padding position (not kept: it reaches nothing), then an inf query.
    weights, inputs = weights_and_inputs("gqa", seed=3)
    inputs["keys"][0, 1, 2] = np.nan
    inputs["values"][1, 0, 0] = np.inf
    inputs["values"][2, 2, 1] = np.inf  # example 2 keeps 2 of 3
    inputs["queries"][1, 3, 0] = np.inf
    layer = layer_of(runner, "gqa", weights)
    cache = layer.init_cache(3, MAX_LENGTH)
    for start, stop, new_lens in ((0, 3, [3, 3, 2]), (3, 4, [1, 1, 1])):
        rows = [x[:, start:stop] for x in inputs.values()]
        held = as_numpy(cache)
        output, cache = layer(*native(rows), int32(new_lens), causal=True, cache=cache)
        expected, _, _ = spec.reference_cached_forward(
            weights, *rows, held, np.array(new_lens), **reference_heads("gqa"), causal=True
        )
        got = backend.to_numpy(output)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
        assert np.isnan(expected).any()
        finite = np.isfinite(expected)
        np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=5e-6)


@pytest.mark.parametrize("recording", [False, True])
def test_a_decode_loop_traces_one_graph_per_kind_of_lengths(monkeypatch, recording):
    # Recording nothing, a call writes its rows in place and attends in the
    # graph of a call without keys: one for the (B,) lengths of steps of
    # one, one for a causal chunk's (B, T), each traced once whatever the
    # call's length and span. Recorded, every call is one functional graph.
    # MXNet's cached graph takes each new shape as it comes.
    traced = []
    original = AttentionGraph.hybrid_forward

    def tracing(graph, F, *args, **kwargs):
        if F is mx.sym:
            traced.append(graph._config)
        return original(graph, F, *args, **kwargs)

    monkeypatch.setattr(AttentionGraph, "hybrid_forward", tracing)
    weights, inputs = weights_and_inputs("gqa")
    layer = layer_of(HYBRID, "gqa", weights)
    with autograd.record() if recording else contextlib.nullcontext():
        HYBRID.decode(layer, inputs, LENGTHS, CHUNKS, max_length=MAX_LENGTH)
    assert len({num_new for num_new, _ in CHUNKS}) == 3
    assert list(layer._graphs.by_config) == traced
    if recording:
        assert len(traced) == 1 and traced[0].cached and traced[0].appends
    else:
        assert [(c.cached, c.appends, c.held_ndim) for c in traced] == [
            (True, False, 2),
            (True, False, 1),
        ]


def as_numpy(cache):
    """A cache of MXNet arrays as float64 numpy (lengths included)."""
    return spec.KVCache(*(backend.to_numpy(x) for x in cache))


def test_an_exported_graph_drops_what_does_not_fit(tmp_path):
    # The exported graph runs without the layer's checks, so it cannot
    # refuse lengths: it clips valid_lens into [0, T], writes nothing at or
    # past max_length, never overwrites a kept position, and counts what it
    # dropped in the lengths.
    weights, inputs = weights_and_inputs("gqa")
    kv_heads = KV_HEADS["gqa"]
    layer = layer_of(HYBRID, "gqa", weights)
    first = [x[:, :3] for x in inputs.values()]
    cache = layer.init_cache(3, 4)
    _, cache = layer(*native(first), int32([3, 1, 0]), causal=True, cache=cache)
    graph, operators = exported(layer, tmp_path)
    assert "gather_nd" in operators  # the positions written: gather + where
    before = as_numpy(cache)
    rows = [x[:, 3:6] for x in inputs.values()]

    with pytest.raises(ValueError, match="overflows: example 0 would hold 6"):
        layer(*native(rows), int32([3, 1, 0]), causal=True, cache=cache)
    # Example 0 holds 3 of 4 and appends 3: one fits. Example 1 asks for 9
    # of the call's 3 positions, example 2 for -2.
    output, *overflowed = graph(*native(rows), int32([3, 9, -2]), *cache)
    after = as_numpy(overflowed)
    assert after.lengths.tolist() == [6, 4, 0]
    for name, x in (("keys", rows[1]), ("values", rows[2])):
        new = projected_heads(weights, x, name[0], kv_heads)  # (B, H_kv, T, dh)
        held, kept = getattr(before, name), getattr(after, name)
        np.testing.assert_array_equal(kept[0, :, :3], held[0, :, :3])
        np.testing.assert_allclose(kept[0, :, 3], new[0, :, 0], rtol=0, atol=5e-6)
        np.testing.assert_array_equal(kept[1, :, :1], held[1, :, :1])
        np.testing.assert_allclose(kept[1, :, 1:], new[1], rtol=0, atol=5e-6)
        np.testing.assert_array_equal(kept[2], held[2])
    # The examples that fit are the in-range call [_, 3, 0].
    expected, _, _ = spec.reference_cached_forward(
        weights, *rows, before, np.array([1, 3, 0]), **reference_heads("gqa"), causal=True
    )
    np.testing.assert_allclose(backend.to_numpy(output)[1:], expected[1:], rtol=0, atol=5e-6)

    # Past max_length, example 0 writes nothing more; the others go on.
    _, *again = graph(*native(rows), int32([1, 0, 1]), *overflowed)
    again = as_numpy(again)
    assert again.lengths.tolist() == [7, 4, 1]
    np.testing.assert_array_equal(again.keys[:2], after.keys[:2])
    np.testing.assert_allclose(
        again.keys[2, :, 0], projected_heads(weights, rows[1], "k", kv_heads)[2, :, 0], atol=5e-6
    )


@pytest.mark.parametrize(("runner", "traces"), [(IMPERATIVE, 3), (HYBRID, 2)])
def test_cached_calls_take_the_fast_route(runner, traces):
    # An imperative layer runs the route on every call, a hybridized one
    # while it traces a configuration's graph: the appending calls share one.
    weights, inputs = weights_and_inputs("gqa")
    layer = layer_of(runner, "gqa", weights)
    first = [x[:, :3] for x in inputs.values()]
    second = [x[:, 3:5] for x in inputs.values()]
    cache = layer.init_cache(3, MAX_LENGTH)
    with backend.kernel_spy() as calls:
        _, cache = layer(*native(first), int32([3, 1, 2]), causal=True, cache=cache)
        held = as_numpy(cache)
        output, cache = layer(*native(second), int32([2, 2, 0]), causal=True, cache=cache)
        appended = as_numpy(cache)
        queries = native(second[:1])[0]
        attended, _ = layer(queries, None, None, causal=True, cache=cache)
        generic, _, _ = layer(
            queries, None, None, causal=True, cache=cache, return_attention_weights=True
        )
    # The mask holds the lengths (with the causal rule in them): no flag.
    assert calls == [KernelCall(mask=True, is_causal=False)] * traces
    expected, _, _ = spec.reference_cached_forward(
        weights, *second, held, np.array([2, 2, 0]), **reference_heads("gqa"), causal=True
    )
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)
    expected, _, _ = spec.reference_cached_forward(
        weights, second[0], None, None, appended, **reference_heads("gqa")
    )
    np.testing.assert_allclose(backend.to_numpy(attended), expected, rtol=0, atol=5e-6)
    np.testing.assert_allclose(backend.to_numpy(generic), expected, rtol=0, atol=5e-6)


def test_the_exported_cached_graph_masks_with_sequence_mask(tmp_path):
    weights, inputs = weights_and_inputs("mha")
    layer = layer_of(HYBRID, "mha", weights)
    rows = native([x[:, :2] for x in inputs.values()])
    operators = {}
    for return_attention_weights in (False, True):
        layer(
            *rows,
            causal=True,
            cache=layer.init_cache(3, 4),
            return_attention_weights=return_attention_weights,
        )
        _, operators[return_attention_weights] = exported(layer, tmp_path)
    assert {"SequenceMask", "batch_dot"} <= operators[False]
    assert "SequenceMask" not in operators[True]


@pytest.mark.parametrize("kind", ["gqa", "mqa"])
def test_grouped_cached_calls_score_each_key_value_head_once(tmp_path, monkeypatch, kind):
    # One batch_dot of queries by cached keys per key/value head and
    # example, its G query heads stacked as rows; no key or value repeated.
    weights, inputs = weights_and_inputs(kind)
    kv_heads, group = KV_HEADS[kind], NUM_HEADS // KV_HEADS[kind]
    seen = []
    original = mx.ndarray.numpy_extension.batch_dot

    def recording(a, b, *args, **kwargs):
        seen.append((a.shape, b.shape))
        return original(a, b, *args, **kwargs)

    layer = layer_of(IMPERATIVE, kind, weights)
    rows = native([x[:, :2] for x in inputs.values()])
    monkeypatch.setattr(mx.ndarray.numpy_extension, "batch_dot", recording)
    layer(*rows, causal=True, cache=layer.init_cache(3, MAX_LENGTH))
    head_dim = NUM_HIDDENS // NUM_HEADS
    blocks, rows_per_block = 3 * kv_heads, group * 2
    # The 2 positions the cache then holds, rounded up to spec.SPAN_BUCKET: all 6.
    cached = (blocks, MAX_LENGTH, head_dim)
    assert seen == [
        ((blocks, rows_per_block, head_dim), cached),
        ((blocks, rows_per_block, MAX_LENGTH), cached),
    ]
    layer = layer_of(HYBRID, kind, weights)
    for return_attention_weights in (False, True):
        layer(
            *rows,
            causal=True,
            cache=layer.init_cache(3, MAX_LENGTH),
            return_attention_weights=return_attention_weights,
        )
        _, operators = exported(layer, tmp_path)
        assert not [op for op in operators if "repeat" in op or "tile" in op]
        assert "broadcast_to" not in operators


@pytest.mark.parametrize("runner", [IMPERATIVE, HYBRID])
def test_a_call_without_keys_needs_no_key_size_and_zeroes_their_gradients(runner):
    # Attending to a cache filled elsewhere: W_k and W_v are not used, so
    # their sizes may stay unknown and their gradients are zero, not what an
    # earlier backward pass left (Gluon's trainer would call that stale).
    kv_heads, head_dim = KV_HEADS["gqa"], NUM_HIDDENS // NUM_HEADS
    layer = MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, num_kv_heads=kv_heads, bias=True)
    layer.initialize(mx.init.Normal(0.5))
    if runner.hybridize:
        layer.hybridize()
    rng = np.random.default_rng(1)
    held = spec.KVCache(
        rng.standard_normal((2, kv_heads, 4, head_dim)),
        rng.standard_normal((2, kv_heads, 4, head_dim)),
        np.array([3, 1], dtype=np.int32),
    )
    cache = KVCache(*native(held[:2]), int32(held.lengths))
    queries = rng.standard_normal((2, 2, QUERY_SIZE)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Gluon warns of unused parameters
        output, after = layer(mx.np.array(queries), None, None, causal=True, cache=cache)
    assert layer.input_sizes() == {"query_size": QUERY_SIZE, "key_size": None, "value_size": None}
    assert after.lengths.tolist() == [3, 1]
    weights = {
        "W_q": layer.W_q.weight.data().asnumpy().T,
        "b_q": layer.W_q.bias.data().asnumpy(),
        "W_o": layer.W_o.weight.data().asnumpy().T,
        "b_o": layer.W_o.bias.data().asnumpy(),
        # Shapes only: a call without keys projects none.
        "W_k": np.zeros((1, kv_heads * head_dim)),
        "W_v": np.zeros((1, kv_heads * head_dim)),
    }
    expected, _, _ = spec.reference_cached_forward(
        weights, queries, None, None, held, **reference_heads("gqa")
    )
    np.testing.assert_allclose(output.asnumpy(), expected, rtol=0, atol=5e-6)

    keys = mx.np.array(rng.standard_normal((2, 2, NUM_HIDDENS)), dtype=np.float32)
    with autograd.record():
        layer(mx.np.array(queries), keys, keys).sum().backward()
    assert np.abs(layer.W_k.weight.grad().asnumpy()).max() > 0
    with autograd.record():
        output, _ = layer(mx.np.array(queries), None, None, cache=cache)
        output.sum().backward()
    for dense in (layer.W_k, layer.W_v):
        for parameter in (dense.weight, dense.bias):
            assert not parameter.grad().asnumpy().any(), parameter.name
    assert np.abs(layer.W_q.weight.grad().asnumpy()).max() > 0


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (list, TypeError, r"cache must be a KVCache\(keys, values, lengths\)"),
        (lambda c: c[:2], TypeError, "cache must be a KVCache"),
        (
            lambda c: c._replace(keys=c.keys.as_nd_ndarray()),
            TypeError,
            "cache.keys must be an mxnet.numpy.ndarray; got NDArray",
        ),
        (
            lambda c: c._replace(values=c.values.astype("float64")),
            TypeError,
            "cache.values dtype float64 differs from the layer's parameter dtype float32",
        ),
        (
            lambda c: c._replace(lengths=c.lengths.astype("float32")),
            TypeError,
            "cache.lengths must be integers",
        ),
    ],
)
@pytest.mark.parametrize("runner", [IMPERATIVE, HYBRID])
def test_a_cache_that_is_not_the_layers_is_refused(runner, change, error, match):
    weights, inputs = weights_and_inputs("gqa")
    layer = layer_of(runner, "gqa", weights)
    rows = native([x[:, :2] for x in inputs.values()])
    with pytest.raises(error, match=match):
        layer(*rows, causal=True, cache=change(layer.init_cache(3, 4)))
    assert not layer._graphs.by_config  # refused before any graph


@pytest.mark.parametrize("runner", [IMPERATIVE, HYBRID])
def test_a_plain_tuple_with_other_integer_lengths_is_a_cache(runner):
    weights, inputs = weights_and_inputs("mha")
    layer = layer_of(runner, "mha", weights)
    rows = [x[:, :2] for x in inputs.values()]
    empty = layer.init_cache(3, 4)
    output, after = layer(
        *native(rows), causal=True, cache=(empty.keys, empty.values, empty.lengths.astype("int64"))
    )
    assert isinstance(after, KVCache) and after.lengths.dtype == np.int32
    assert after.lengths.tolist() == [2, 2, 2]
    held = as_numpy(empty)
    expected, _, _ = spec.reference_cached_forward(
        weights, *rows, held, **reference_heads("mha"), causal=True
    )
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)


def test_init_cache_takes_a_dtype_and_a_device():
    weights, _ = weights_and_inputs("gqa")
    layer = layer_of(IMPERATIVE, "gqa", weights, dtype="float64")
    cache = layer.init_cache(2, 3, "float16", ctx=mx.cpu(0))
    assert cache.keys.dtype == cache.values.dtype == np.float16
    assert cache.keys.ctx == cache.lengths.ctx == mx.cpu(0)
    assert layer.init_cache(2, 3).keys.dtype == np.float64
    with pytest.raises(TypeError, match="max_length must be a non-negative int"):
        layer.init_cache(2, 3.0)


@pytest.mark.parametrize("runner", [IMPERATIVE, HYBRID])
def test_dropout_acts_on_the_cached_fast_route_in_training_only(runner):
    weights, inputs = weights_and_inputs("gqa")
    layer = layer_of(runner, "gqa", weights, dropout=0.5)
    rows = [x[:, :3] for x in inputs.values()]
    lens = int32([3, 2, 1])
    with backend.kernel_spy() as calls:
        dropped, _ = runner.forward(
            layer, *native(rows), lens, training=True, causal=True, cache=layer.init_cache(3, 4)
        )
        output, _ = runner.forward(
            layer, *native(rows), lens, causal=True, cache=layer.init_cache(3, 4)
        )
    assert calls[0] == KernelCall(mask=True, is_causal=False, dropout=0.5)
    held = as_numpy(layer.init_cache(3, 4))
    expected, _, _ = spec.reference_cached_forward(
        weights, *rows, held, np.array([3, 2, 1]), **reference_heads("gqa"), causal=True
    )
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)
    assert not np.allclose(backend.to_numpy(dropped), expected, atol=1e-3)
