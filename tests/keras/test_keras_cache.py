"""The key/value cache on the active Keras backend: what is Keras' own.

``tests/backends/test_cache.py`` checks the cache's semantics on every
backend. These tests check the compiled step (``tf.function(jit_compile=True)``
on TensorFlow, ``jax.jit`` of ``stateless_call`` on JAX; on PyTorch what the
layer does while ``torch.compile`` traces it), what unchecked code does when
the cache overflows, that cached calls go through the fused kernel where the
kernel plan says so (grouped key/value heads included), and Keras' call
handling: lazy building, the functional API, dtypes. Every number is checked
against the float64 reference.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from keras_testing import (  # noqa: E402, F401
    eager_flow,
    fused_kernel_here,
    keras_runner,
    kernel_key_heads,
)
from option_cases import LENGTH_DEPENDENT_ROTARY  # noqa: E402

import mha_multi.keras._kernel as kernel_module  # noqa: E402
from conftest import device_or_skip, recording_host_moves, without_synchronisation  # noqa: E402
from mha_multi import spec  # noqa: E402
from mha_multi.keras import KVCache, MultiHeadAttention, set_weights  # noqa: E402
from mha_multi.parity.decode import decode, full_reference  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402
from mha_multi.weights import init_weights  # noqa: E402

#: Grouped-query attention with an explicit head size and biases.
CONFIG = {"num_hiddens": 8, "num_heads": 4, "num_kv_heads": 2, "head_dim": 3}
HEADS = {"num_heads": 4, "num_kv_heads": 2}
#: Ragged lengths 5, 3, 2 fed as a padded prefill of 3, two calls of 1, one of 2.
LENGTHS = np.array([5, 3, 2])
SCHEDULE = [(3, [3, 2, 0]), (1, [1, 1, 0]), (1, [1, 0, 0]), (2, [0, 0, 2])]
MAX_LENGTH = 6


def grouped_weights(seed=0, **heads):
    heads = {**CONFIG, **heads}
    return init_weights(heads.pop("num_hiddens"), bias=True, seed=seed, **heads)


def layer_of(weights, dtype="float32", **heads):
    layer = MultiHeadAttention(**{**CONFIG, **heads}, bias=True, dtype=dtype)
    return set_weights(layer, weights)


def sequences(seed=0, length=6):
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal((3, length, 8)).astype(np.float32) for name in backend.INPUT_NAMES
    }


def native_cache(cache):
    return KVCache(*(backend.to_numpy(x) for x in cache))


def traced_step(layer, monkeypatch):
    """The cached call as compiled code runs it, and the list of its traces.

    TensorFlow: ``tf.function(jit_compile=True)``; JAX: ``jax.jit`` of
    ``stateless_call``; PyTorch: the eager call while ``torch.compile`` is
    said to be tracing (lengths unreadable), without paying for a compiler.
    """
    traces = []
    if backend.BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def step(q, k, v, lens, cache):
            traces.append(q.shape)
            return layer(q, k, v, lens, causal=True, cache=cache)

        return step, traces
    if backend.BACKEND == "jax":
        import jax

        @jax.jit
        def jitted(values, q, k, v, lens, cache):
            traces.append(q.shape)
            result, _ = layer.stateless_call(*values, q, k, v, lens, causal=True, cache=cache)
            return result

        return (lambda *inputs: jitted(backend.state(layer), *inputs)), traces
    import torch

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    def traced(q, k, v, lens, cache):
        traces.append(q.shape)
        return layer(q, k, v, lens, causal=True, cache=cache)

    return traced, traces


def eager_step(layer):
    def step(q, k, v, lens, cache):
        return layer(q, k, v, lens, causal=True, cache=cache)

    return step


def run_schedule(layer, step):
    """The outputs of :data:`SCHEDULE` at the real positions, and the last cache."""
    cache = layer.init_cache(3, MAX_LENGTH)

    def numpy_step(q, k, v, new_lens):
        nonlocal cache
        tensors = (backend.to_native(x) for x in (q, k, v))
        output, cache = step(*tensors, backend.lens_to_native(new_lens), cache)
        return backend.to_numpy(output)

    return decode(numpy_step, sequences(), LENGTHS, SCHEDULE), native_cache(cache)


# -- the compiled step ---------------------------------------------------------------


def test_the_compiled_step_is_the_eager_call_and_the_full_forward(monkeypatch):
    weights = grouped_weights()
    layer = layer_of(weights)
    step, traces = traced_step(layer, monkeypatch)
    with backend.kernel_spy() as calls:
        compiled, compiled_cache = run_schedule(layer, step)
    assert calls == []  # the values are unreadable: the generic path, exact for all
    if backend.BACKEND != "torch":
        # One trace per call length (3, 1, 2), not one per step.
        assert [shape[1] for shape in traces] == [3, 1, 2]
    monkeypatch.undo()
    eager, eager_cache = run_schedule(layer, eager_step(layer))
    expected = full_reference(weights, sequences(), LENGTHS, **HEADS)
    np.testing.assert_allclose(compiled, expected, rtol=0, atol=5e-6)
    np.testing.assert_allclose(compiled, eager, rtol=0, atol=1e-6)
    assert compiled_cache.lengths.tolist() == eager_cache.lengths.tolist() == LENGTHS.tolist()
    held = (np.arange(MAX_LENGTH) < LENGTHS[:, None])[:, None, :, None]
    for name in ("keys", "values"):
        compiled_held, eager_held = (
            np.where(held, getattr(c, name), 0) for c in (compiled_cache, eager_cache)
        )
        np.testing.assert_allclose(compiled_held, eager_held, rtol=0, atol=1e-6)


def test_unchecked_code_drops_what_overflows_and_keeps_counting(monkeypatch):
    weights = grouped_weights(1)
    layer = layer_of(weights)
    x = sequences(1)
    cache = layer.init_cache(3, 4)
    prompt = [backend.to_native(x[name][:, :3]) for name in backend.INPUT_NAMES]
    _, cache = layer(*prompt, backend.lens_to_native(np.array([3, 1, 0])), causal=True, cache=cache)
    before = native_cache(cache)
    new = [backend.to_native(x[name][:, 3:6]) for name in backend.INPUT_NAMES]
    new_lens = backend.lens_to_native(np.array([3, 2, 1]))
    with pytest.raises(ValueError, match="overflows: example 0 would hold 6"):
        layer(*new, new_lens, causal=True, cache=cache)
    step, _ = traced_step(layer, monkeypatch)
    output, after = step(*new, new_lens, cache)
    after = native_cache(after)
    assert after.lengths.tolist() == [6, 3, 1]  # lengths > max_length tells
    # Example 0 keeps its 3 positions and the first new one; the rest is dropped.
    projected_k = (x["keys"][:, 3:6] @ weights["W_k"] + weights["b_k"]).reshape(3, 3, 2, 3)
    np.testing.assert_array_equal(after.keys[0, :, :3], before.keys[0, :, :3])
    np.testing.assert_allclose(after.keys[0, :, 3], projected_k[0, 0], rtol=0, atol=5e-6)
    # Examples that fit are what an eager call gives them.
    fits = [1, 2]
    subset = KVCache(*(field[fits] for field in before))
    rows = [x[name][fits, 3:6] for name in backend.INPUT_NAMES]
    expected, _, expected_cache = spec.reference_cached_forward(
        weights, *rows, subset, np.array([2, 1]), **HEADS, causal=True
    )
    real = np.array([[True, True, False], [True, False, False]])
    np.testing.assert_allclose(
        backend.to_numpy(output)[fits][real], expected[real], rtol=0, atol=5e-6
    )
    for b, example in enumerate(fits):
        kept = expected_cache.lengths[b]
        np.testing.assert_allclose(
            after.keys[example, :, :kept], expected_cache.keys[b, :, :kept], rtol=0, atol=5e-6
        )


@pytest.mark.skipif(backend.BACKEND != "jax", reason="jax.jit is JAX's")
def test_a_cache_made_inside_a_jitted_stateless_call():
    # The layer's variables are tracers there, with no device to ask.
    import jax

    class Prefill(keras.layers.Layer):
        def __init__(self, attention):
            super().__init__()
            self.attention = attention

        def call(self, x):
            return self.attention(x, x, x, causal=True, cache=self.attention.init_cache(3, 4))

    weights = grouped_weights(5)
    prefill = Prefill(layer_of(weights))
    x = sequences(5)["queries"][:, :2]
    prefill.build(x.shape)  # its attention layer is built
    compiled = jax.jit(lambda values, x: prefill.stateless_call(*values, x)[0])
    output, cache = compiled(backend.state(prefill), x)
    expected, _ = spec.reference_forward(weights, x, x, x, num_heads=4, causal=True)
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)
    assert backend.to_numpy(cache.lengths).tolist() == [2, 2, 2]


@pytest.mark.skipif(backend.BACKEND != "torch", reason="torch.compile is PyTorch's")
def test_torch_compile_takes_a_rotary_grouped_step_whole():
    """Keras on PyTorch: a Llama-shaped layer's cached call (rotary, grouped heads) is one
    graph under ``torch.compile(fullgraph=True)`` (no break, from the first call on),
    the prompt and the step one graph each, not one per token, the rows written into the
    given cache; the float64 reference's numbers at every step."""
    import torch
    import torch._dynamo

    rotary = {"theta": 100.0}
    weights = grouped_weights(6, head_dim=4)  # (rotation pairs entries)
    layer = MultiHeadAttention(**{**CONFIG, "head_dim": 4}, bias=True, rotary=rotary)
    layer = set_weights(layer, weights)
    x = sequences(6)["queries"]

    def call(tokens, keys, values, lengths):
        output, cache = layer(
            tokens, tokens, tokens, causal=True, cache=KVCache(keys, values, lengths)
        )
        return output, tuple(cache)

    prompt, steps = 3, 3
    cache = tuple(layer.init_cache(3, MAX_LENGTH))
    given = [x.data_ptr() for x in cache[:2]]
    torch._dynamo.reset()
    # (fullgraph: a graph break raises.)
    compiled = torch.compile(call, fullgraph=True, dynamic=False, backend="eager")
    graphs = []
    outputs = []
    with torch.no_grad():
        at = 0
        for width in (prompt,) + (1,) * steps:
            output, cache = compiled(backend.to_native(x[:, at : at + width]), *cache)
            outputs.append(backend.to_numpy(output))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            at += width
    assert graphs[1] == graphs[-1]  # the steps after the first compile nothing
    # Recording no gradient, the rows went into the given cache's own tensors.
    assert [x.data_ptr() for x in cache[:2]] == given
    expected, _ = spec.reference_forward(
        weights, x[:, :at], x[:, :at], x[:, :at], **HEADS, causal=True, rotary=rotary
    )
    np.testing.assert_allclose(np.concatenate(outputs, 1), expected, rtol=0, atol=5e-6)
    assert backend.to_numpy(cache[2]).tolist() == [at] * 3


@pytest.mark.skipif(backend.BACKEND != "torch", reason="torch.compile is PyTorch's")
def test_torch_compile_takes_a_call_whole_whatever_dtypes_it_meets_first(monkeypatch):
    """Keras on PyTorch: the dtype names a call looks up were memoised inside the trace
    where a compiled call met a dtype first (int32 lengths): a dict mutation, after which
    dynamo read no mapping proxy, and Keras' call reads one (``fullgraph`` broke). The
    memos are written outside traces only."""
    import torch
    import torch._dynamo

    from mha_multi.keras import _ops

    weights = grouped_weights(8)
    layer = set_weights(MultiHeadAttention(**CONFIG, bias=True), weights)
    x = sequences(8)["queries"]
    lens = np.array([6, 2, 4], np.int32)
    monkeypatch.setattr(_ops, "_NAMES", {})  # (no dtype met yet)
    monkeypatch.setattr(_ops, "_KIND_OF", {})
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, n: layer(q, q, q, n), fullgraph=True, dynamic=False, backend="eager"
    )
    output = compiled(backend.to_native(x), torch.from_numpy(lens))
    expected, _ = spec.reference_forward(weights, x, x, x, lens, **HEADS)
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)
    assert not _ops._NAMES and not _ops._KIND_OF


@pytest.mark.skipif(backend.BACKEND != "torch", reason="torch.compile is PyTorch's")
def test_torch_compile_takes_a_call_with_positions_whole():
    """Keras on PyTorch: a call given its positions (a tensor) is one graph under
    ``torch.compile(fullgraph=True)``: the check of positions on the host asked the backend
    its integers, a tensor made inside the trace, where a tensor needs none."""
    import torch
    import torch._dynamo

    rotary = {"theta": 100.0}
    weights = grouped_weights(6, head_dim=4)
    layer = MultiHeadAttention(**{**CONFIG, "head_dim": 4}, bias=True, rotary=rotary)
    layer = set_weights(layer, weights)
    x = sequences(6)["queries"]
    positions = np.array([[4, 1, 7, 2, 0, 3]] * 3)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, p: layer(q, q, q, positions=p), fullgraph=True, backend="eager"
    )
    output = compiled(backend.to_native(x), torch.from_numpy(positions))
    expected, _ = spec.reference_forward(
        weights, x, x, x, **HEADS, rotary=rotary, positions=positions
    )
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "torch", reason="torch.compile is PyTorch's")
def test_torch_compile_takes_a_call_rotated_by_its_length_whole():
    """Keras on PyTorch: LongRoPE's frequencies depend on a call's length, a number on the
    host where shapes are static, computed in Python's numbers under
    ``torch.compile(fullgraph=True)`` (numpy's 0-d arrays broke the graph), beyond the
    original context too."""
    import torch
    import torch._dynamo

    rotary = {"theta": 100.0, "scaling": LENGTH_DEPENDENT_ROTARY["longrope"]}
    weights = grouped_weights(7, head_dim=4)
    layer = MultiHeadAttention(**{**CONFIG, "head_dim": 4}, bias=True, rotary=rotary)
    layer = set_weights(layer, weights)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q: layer(q, q, q, causal=True), fullgraph=True, dynamic=False, backend="eager"
    )
    for length in (3, 6):
        x = sequences(7, length)["queries"]
        expected, _ = spec.reference_forward(weights, x, x, x, **HEADS, rotary=rotary, causal=True)
        output = compiled(backend.to_native(x))
        np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)


# -- eager writes ------------------------------------------------------------------


def functional_updates(monkeypatch):
    """Records each call of the spec's functional update of a cache (its gather, or the
    scatter a traced call on JAX takes)."""
    calls = []

    def recorded(original):
        def recording(*args, **kwargs):
            calls.append(args[3].shape[1])  # the new positions
            return original(*args, **kwargs)

        return recording

    monkeypatch.setattr(spec, "update_cache", recorded(spec.update_cache))
    return calls


def without_gradients(recorded):
    """Where gradients are not recorded: ``torch.no_grad()`` on Keras' PyTorch backend."""
    if recorded or backend.BACKEND != "torch":
        return contextlib.nullcontext()
    import torch

    return torch.no_grad()


def prefilled(layer, x, lengths, max_length):
    """A cache of ``max_length`` holding ``lengths`` of ``x``'s first three positions."""
    cache = layer.init_cache(3, max_length)
    prompt = [backend.to_native(x[name][:, :3]) for name in backend.INPUT_NAMES]
    _, cache = layer(*prompt, backend.lens_to_native(np.array(lengths)), causal=True, cache=cache)
    return cache


def checked_step(layer, weights, x, cache, position):
    """A causal call of ``x``'s ``position`` on ``cache``, its output checked against the
    reference's; returns the call's cache and the reference's."""
    before = native_cache(cache)
    rows = [x[name][:, position : position + 1] for name in backend.INPUT_NAMES]
    output, cache = layer(*map(backend.to_native, rows), causal=True, cache=cache)
    expected, _, expected_cache = spec.reference_cached_forward(
        weights, *rows, before, **HEADS, causal=True
    )
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)
    return cache, expected_cache


def assert_cache_is(cache, expected):
    """The lengths, and every position they hold, those of the reference's cache."""
    cache = native_cache(cache)
    assert cache.lengths.tolist() == expected.lengths.tolist()
    for b, held in enumerate(expected.lengths):
        for name in ("keys", "values"):
            np.testing.assert_allclose(
                getattr(cache, name)[b, :, :held],
                getattr(expected, name)[b, :, :held],
                rtol=0,
                atol=5e-6,
            )


@pytest.mark.usefixtures("eager_flow")
@pytest.mark.parametrize("recorded", [True, False], ids=["gradients", "no gradients"])
@pytest.mark.parametrize("room", [0, 1], ids=["fills the cache", "leaves room"])
@pytest.mark.parametrize("chunk", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_an_eager_call_at_one_position_writes_its_rows_as_a_slice(
    monkeypatch, causal, chunk, room, recorded
):
    weights = grouped_weights(6)
    layer = layer_of(weights)
    x = sequences(6)
    with without_gradients(recorded):
        cache = prefilled(layer, x, [3, 3, 3], 3 + chunk + room)
        before = native_cache(cache)
        rows = [x[name][:, 3 : 3 + chunk] for name in backend.INPUT_NAMES]
        functional = functional_updates(monkeypatch)
        output, after = layer(*map(backend.to_native, rows), causal=causal, cache=cache)
    assert functional == []
    expected, _, expected_cache = spec.reference_cached_forward(
        weights, *rows, before, **HEADS, causal=causal
    )
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)
    assert_cache_is(after, expected_cache)
    if backend.BACKEND == "torch" and not recorded:
        # No gradient through it: written in place, as PyTorch's own layer does.
        assert after.keys is cache.keys and after.values is cache.values
    else:
        np.testing.assert_array_equal(native_cache(cache).keys, before.keys)


@pytest.mark.usefixtures("eager_flow")
def test_eager_steps_attend_over_the_filled_positions_rounded_to_the_bucket(monkeypatch):
    """Steps at one position attend over the positions filled, rounded up to the
    backend's bucket (the spec's on TensorFlow and JAX, 1 on PyTorch's CPU) and never
    past ``max_length``, to the reference's numbers."""
    from mha_multi.keras._facts import FACTS

    weights = grouped_weights(8)
    layer = layer_of(weights)
    max_length = spec.SPAN_BUCKET + 6
    x = sequences(8, length=max_length)
    spans = []
    original = FACTS.cache_prefix

    def recording(keys, values, span):
        spans.append(span)
        return original(keys, values, span)

    monkeypatch.setattr(FACTS, "cache_prefix", recording)
    first = spec.SPAN_BUCKET - 2
    with without_gradients(False):
        cache = layer.init_cache(3, max_length)
        prompt = [backend.to_native(x[name][:, :first]) for name in backend.INPUT_NAMES]
        _, cache = layer(*prompt, causal=True, cache=cache)
        for position in range(first, first + 4):
            cache, _ = checked_step(layer, weights, x, cache, position)
    bucket = 1 if backend.BACKEND == "torch" else spec.SPAN_BUCKET
    filled = [first, *range(first + 1, first + 5)]  # the prefill's, then each step's
    expected_spans = [min(-(-n // bucket) * bucket, max_length) for n in filled]
    assert spans == [span for span in expected_spans if span < max_length]


@pytest.mark.parametrize("recorded", [True, False], ids=["gradients", "no gradients"])
@pytest.mark.parametrize(
    ("lengths", "new_lens"),
    [([3, 1, 2], None), ([3, 3, 3], [1, 0, 1])],
    ids=["ragged lengths", "ragged new positions"],
)
def test_a_ragged_eager_call_writes_its_rows_where_each_example_is(
    monkeypatch, lengths, new_lens, recorded
):
    """Into the cache's own tensors on Keras' PyTorch backend, recording no gradient
    (no functional update); elsewhere by the spec's functional update, the given
    cache unchanged. The reference's output and cache either way."""
    weights = grouped_weights(7)
    layer = layer_of(weights)
    x = sequences(7)
    with without_gradients(recorded):
        cache = prefilled(layer, x, lengths, MAX_LENGTH)
        before = native_cache(cache)
        rows = [x[name][:, 3:4] for name in backend.INPUT_NAMES]
        functional = functional_updates(monkeypatch)
        lens = None if new_lens is None else backend.lens_to_native(np.array(new_lens))
        output, after = layer(*map(backend.to_native, rows), lens, causal=True, cache=cache)
    in_place = backend.BACKEND == "torch" and not recorded
    assert functional == ([] if in_place else [1])
    expected, _, expected_cache = spec.reference_cached_forward(
        weights, *rows, before, new_lens, **HEADS, causal=True
    )
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)
    assert_cache_is(after, expected_cache)
    if in_place:
        assert after.keys is cache.keys and after.values is cache.values
        # Nothing past each example's new length changed.
        held = native_cache(after)
        for b, length in enumerate(expected_cache.lengths):
            for name in ("keys", "values"):
                np.testing.assert_array_equal(
                    getattr(held, name)[b, :, length:], getattr(before, name)[b, :, length:]
                )
    else:
        np.testing.assert_array_equal(native_cache(cache).keys, before.keys)


@pytest.mark.parametrize("causal", [False, True])
def test_eager_cached_calls_of_an_empty_batch(causal):
    """Eager cached calls of no examples (the first through Keras' call, the second
    past it): the reference's empty output and a cache of the same shapes. (JAX's
    ``take`` of no rows drops the indices' axes: the layer's gather says them.)"""
    weights = grouped_weights(9)
    layer = layer_of(weights)
    x = {name: values[:0] for name, values in sequences(9).items()}
    cache = layer.init_cache(0, MAX_LENGTH)
    for _ in range(2):
        before = native_cache(cache)
        output, cache = layer(
            *(backend.to_native(x[name]) for name in backend.INPUT_NAMES),
            causal=causal,
            cache=cache,
        )
        expected, _, _ = spec.reference_cached_forward(
            weights, *(x[name] for name in backend.INPUT_NAMES), before, **HEADS, causal=causal
        )
        assert backend.to_numpy(output).shape == expected.shape == (0, 6, 8)
        assert native_cache(cache)[0].shape == (0, 2, MAX_LENGTH, 3)


@pytest.mark.parametrize("recorded", [True, False], ids=["gradients", "no gradients"])
def test_an_overflow_at_one_position_is_refused_and_writes_nothing(recorded):
    layer = layer_of(grouped_weights(8))
    x = sequences(8)
    with without_gradients(recorded):
        cache = prefilled(layer, x, [3, 3, 3], 4)
        before = native_cache(cache)
        rows = [backend.to_native(x[name][:, 3:5]) for name in backend.INPUT_NAMES]
        with pytest.raises(ValueError, match="overflows: example 0 would hold 5"):
            layer(*rows, causal=True, cache=cache)
    for held, kept in zip(native_cache(cache), before, strict=True):
        np.testing.assert_array_equal(held, kept)


@pytest.mark.usefixtures("eager_flow")
@pytest.mark.parametrize("recorded", [True, False], ids=["gradients", "no gradients"])
def test_non_finite_rows_at_one_position_give_the_references_numbers(monkeypatch, recorded):
    # Example 0's new query is NaN, example 1's new key +inf; the next call
    # attends to the cache holding them.
    weights = grouped_weights(9)
    layer = layer_of(weights)
    x = sequences(9)
    x["queries"][0, 3, 1] = np.nan
    x["keys"][1, 3, 2] = np.inf
    x["values"][2, 4, 0] = -np.inf
    with without_gradients(recorded):
        cache = prefilled(layer, x, [3, 3, 3], MAX_LENGTH)
        functional = functional_updates(monkeypatch)
        for start in (3, 4):
            cache, expected_cache = checked_step(layer, weights, x, cache, start)
            assert_cache_is(cache, expected_cache)
    assert functional == []


@pytest.mark.parametrize("recorded", [True, False], ids=["gradients", "no gradients"])
def test_a_step_reads_none_of_the_lengths_the_call_before_returned(monkeypatch, recorded):
    """The lengths an eager call returns are known on the host to the next call,
    which then reads nothing from the device (a read waits for a GPU; the facts are
    told the tensors are on one, so that no values are read for the kernel either).
    Lengths that did not come from a call, or were changed since, are read."""
    from mha_multi.keras import _facts as facts

    reads = []
    as_numpy = facts.as_numpy
    monkeypatch.setattr(facts, "as_numpy", lambda x: reads.append(1) or as_numpy(x))
    monkeypatch.setattr(facts, "device_of", lambda x: "gpu")
    weights = grouped_weights(11)
    layer = layer_of(weights)
    x = sequences(11)

    def step(cache, position, lens=None):
        before = native_cache(cache)
        count = 1 if lens is None else int(max(lens))
        rows = [x[name][:, position : position + count] for name in backend.INPUT_NAMES]
        given = () if lens is None else (backend.lens_to_native(lens),)
        reads.clear()
        output, cache = layer(*map(backend.to_native, rows), *given, causal=True, cache=cache)
        read = len(reads)
        expected, _, expected_cache = spec.reference_cached_forward(
            weights, *rows, before, lens, **HEADS, causal=True
        )
        np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)
        assert_cache_is(cache, expected_cache)
        return read, cache

    with without_gradients(recorded):
        cache = layer.init_cache(3, MAX_LENGTH + 2)
        read, cache = step(cache, 0)
        assert read == 1  # init_cache's lengths
        for position in (1, 2):
            read, cache = step(cache, position)
            assert read == 0
        # The same arrays with lengths of another tensor: read.
        lengths = keras.ops.convert_to_tensor(native_cache(cache).lengths.astype(np.int32))
        read, cache = step(KVCache(cache.keys, cache.values, lengths), 3)
        assert read == 1
        if backend.BACKEND == "torch":
            # Lengths written in place since: read.
            import torch

            with torch.no_grad():
                cache.lengths.sub_(1)
            read, cache = step(cache, 3)
            assert read == 1
            # Other storage swapped in through .data (which keeps the version counter): read.
            cache.lengths.data = cache.lengths.data - 1
            read, cache = step(cache, 3)
            assert read == 1
        read, cache = step(cache, 4)
        assert read == 0
        # A ragged call (its examples append 1, 0 and 0 positions) reads its
        # own lengths; the step after it reads nothing.
        read, cache = step(cache, 5, np.array([1, 0, 0]))
        assert read == 1
        read, cache = step(cache, 5)
        assert read == 0


@pytest.mark.skipif(backend.BACKEND != "torch", reason="PyTorch's function modes")
@pytest.mark.parametrize(
    "cached, held",
    [(True, [3, 3, 3]), (True, [3, 1, 2]), (False, [3, 3, 3])],
    ids=["a step", "a step of a ragged batch", "a short call"],
)
def test_a_call_on_pytorch_moves_nothing_between_host_and_device(monkeypatch, cached, held):
    """What would wait for a GPU in a short call on Keras' PyTorch backend, a
    decoding step or a call without a cache: no read to the host, and no tensor
    made of host data (a copy to a GPU from pageable memory waits too). The
    facts are told the tensors are on a GPU."""
    import torch

    from mha_multi.keras import _facts as facts

    monkeypatch.setattr(facts, "device_of", lambda x: "gpu")
    weights = grouped_weights(12)
    layer = layer_of(weights)
    x = sequences(12)
    with torch.no_grad():
        cache = prefilled(layer, x, held, MAX_LENGTH)
        rows = [x[name][:, 3:4] for name in backend.INPUT_NAMES]
        native = [backend.to_native(row) for row in rows]
        before = native_cache(cache)
        with recording_host_moves() as moved:
            if cached:
                output, cache = layer(*native, causal=True, cache=cache)
            else:
                output = layer(*native, causal=True)
    assert moved == []
    if cached:
        expected, _, expected_cache = spec.reference_cached_forward(
            weights, *rows, before, **HEADS, causal=True
        )
        assert_cache_is(cache, expected_cache)
    else:
        expected, _ = spec.reference_forward(weights, *rows, **HEADS, causal=True)
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "torch", reason="PyTorch's synchronisation debug mode")
def test_decoding_and_a_short_call_on_gpu_never_synchronize():
    """On a CUDA device neither decoding steps nor a short call without a cache
    wait for the device: ``torch.cuda.set_sync_debug_mode("error")`` raises at
    any wait. The lengths the call before returned are known on the host, and
    below ``spec.DEVICE_READ_SCORES`` scores no value is read for the kernel."""
    import torch

    gpu = device_or_skip("gpu", backend.gpu_available(), "no CUDA device")
    weights = grouped_weights(14)
    x = sequences(14)
    with backend.device_scope(gpu):
        layer = layer_of(weights)
        cache = layer.init_cache(3, MAX_LENGTH)

    def rows(start, stop):
        arrays = [x[name][:, start:stop] for name in backend.INPUT_NAMES]
        return arrays, [backend.to_native(array, gpu) for array in arrays]

    with torch.no_grad():
        _, prompt = rows(0, 3)
        lengths = backend.lens_to_native(np.array([3, 2, 3]), gpu)
        _, cache = layer(*prompt, lengths, causal=True, cache=cache)  # reads init_cache's lengths
        for position in (3, 4, 5):
            arrays, inputs = rows(position, position + 1)
            before = native_cache(cache)
            output, cache = without_synchronisation(
                lambda inputs=inputs, cache=cache: layer(*inputs, causal=True, cache=cache)
            )
            expected, _, expected_cache = spec.reference_cached_forward(
                weights, *arrays, before, **HEADS, causal=True
            )
            np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)
            assert_cache_is(cache, expected_cache)
        arrays, inputs = rows(0, 4)
        output = without_synchronisation(lambda: layer(*inputs, causal=True))
    expected, _ = spec.reference_forward(weights, *arrays, **HEADS, causal=True)
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)


def test_compiled_calls_keep_the_functional_update(monkeypatch):
    layer = layer_of(grouped_weights(10))
    step, traces = traced_step(layer, monkeypatch)
    functional = functional_updates(monkeypatch)
    run_schedule(layer, step)
    assert functional == [shape[1] for shape in traces]


@pytest.mark.skipif(backend.BACKEND != "jax", reason="a traced call scatters on JAX only")
def test_traced_calls_on_jax_scatter_their_rows(monkeypatch):
    """Under ``jax.jit`` the spec's gather would recompute each new row's producer at every
    cache position: a traced call writes its rows by one scatter instead (its numbers are
    the eager call's and the reference's: the compiled step's test above)."""
    layer = layer_of(grouped_weights(10))
    step, traces = traced_step(layer, monkeypatch)
    scatters = []
    original = spec.update_cache

    def recording(*args, **kwargs):
        scatters.append(kwargs.get("scatter") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(spec, "update_cache", recording)
    run_schedule(layer, step)
    assert scatters == [True] * len(traces)


# -- the kernel plan ---------------------------------------------------------------


@pytest.mark.usefixtures("eager_flow")
@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_cached_calls_take_the_kernel_where_the_plan_says(
    runner, num_kv_heads, fused_here, monkeypatch
):
    # Example 2 holds nothing in the second call: a fully hidden row, the
    # mean of all max_length positions of its key/value head.
    weights = grouped_weights(2, num_kv_heads=num_kv_heads)
    layer = layer_of(weights, num_kv_heads=num_kv_heads)
    heads = {"num_heads": 4, "num_kv_heads": num_kv_heads}
    x = sequences(2)
    cache = layer.init_cache(3, MAX_LENGTH)
    prompt = [backend.to_native(x[name][:, :3]) for name in backend.INPUT_NAMES]
    with runner.kernel_spy() as calls:
        _, cache = layer(
            *prompt, backend.lens_to_native(np.array([3, 1, 0])), causal=True, cache=cache
        )
    before = native_cache(cache)
    new_lens = np.array([2, 0, 0])
    rows = [x[name][:, 3:5] for name in backend.INPUT_NAMES]
    key_heads = kernel_key_heads(monkeypatch)
    with runner.kernel_spy() as more:
        output, _ = layer(
            *map(backend.to_native, rows),
            backend.lens_to_native(new_lens),
            causal=True,
            cache=cache,
        )
    calls += more
    expected, _, _ = spec.reference_cached_forward(
        weights, *rows, before, new_lens, **heads, causal=True
    )
    # The lengths hold the causal rule: a mask, and no causal flag.
    assert [(call.mask, call.is_causal) for call in calls] == [(True, False)] * 2
    takes_groups = kernel_module.DOT_PRODUCT_ATTENTION.takes_grouped_heads
    assert key_heads == [num_kv_heads if takes_groups else 4]
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)
    with runner.kernel_spy() as calls:
        generic, weights_out, _ = layer(
            *map(backend.to_native, rows),
            backend.lens_to_native(new_lens),
            causal=True,
            cache=cache,
            return_attention_weights=True,
        )
    assert calls == []  # the weights are asked for
    np.testing.assert_allclose(backend.to_numpy(generic), expected, rtol=0, atol=5e-6)
    assert tuple(weights_out.shape) == (3, 4, 2, MAX_LENGTH)


# -- Keras' call handling ----------------------------------------------------------


def test_a_lazy_layer_is_built_by_its_first_cached_call():
    weights = grouped_weights(3)
    x = sequences(3)
    rows = [x[name][:, :2] for name in backend.INPUT_NAMES]
    layer = MultiHeadAttention(**CONFIG, bias=True)
    assert not layer.built
    cache = layer.init_cache(3, 4)
    output, cache = layer(*rows, causal=True, cache=cache)  # numpy, converted by Keras
    assert layer.input_sizes() == {"query_size": 8, "key_size": 8, "value_size": 8}
    set_weights(layer, weights)
    output, _ = layer(*rows, causal=True, cache=layer.init_cache(3, 4))
    expected, _, _ = spec.reference_cached_forward(
        weights, *rows, native_cache(layer.init_cache(3, 4)), **HEADS, causal=True
    )
    np.testing.assert_allclose(backend.to_numpy(output), expected, rtol=0, atol=5e-6)


def test_a_first_call_without_keys_needs_their_sizes():
    queries = np.zeros((3, 1, 8), np.float32)
    lazy = MultiHeadAttention(**CONFIG)
    with pytest.raises(ValueError, match="key_size and value_size not known yet"):
        lazy(queries, None, None, cache=lazy.init_cache(3, 4))
    # Known key and value sizes: the queries alone build the rest.
    sized = MultiHeadAttention(**CONFIG, key_size=5, value_size=6)
    output, cache = sized(queries, None, None, cache=sized.init_cache(3, 4))
    assert sized.input_sizes() == {"query_size": 8, "key_size": 5, "value_size": 6}
    assert tuple(output.shape) == (3, 1, 8)
    assert backend.to_numpy(cache.lengths).tolist() == [0, 0, 0]


def test_the_functional_api_gives_the_cache_symbolically():
    layer = MultiHeadAttention(**CONFIG, query_size=5, key_size=8, value_size=8)
    shape = (2, 2, 6, 3)
    cache = KVCache(
        keras.KerasTensor(shape), keras.KerasTensor(shape), keras.KerasTensor((2,), "int32")
    )
    q = keras.KerasTensor((2, 1, 5))
    kv = keras.KerasTensor((2, 1, 8))
    output, weights, after = layer(
        q, kv, kv, causal=True, cache=cache, return_attention_weights=True
    )
    assert isinstance(after, KVCache)
    assert tuple(output.shape) == (2, 1, 8) and tuple(weights.shape) == (2, 4, 1, 6)
    assert tuple(after.keys.shape) == shape and after.lengths.dtype == "int32"
    with pytest.raises(ValueError, match="cache.keys must have shape"):
        layer(q, kv, kv, cache=KVCache(keras.KerasTensor((2, 4, 6, 3)), *cache[1:]))


@pytest.mark.parametrize("dtype", ["mixed_bfloat16", "float16"])
def test_the_cache_takes_the_compute_dtype(dtype):
    layer = layer_of(grouped_weights(4), dtype=dtype)
    compute = keras.backend.standardize_dtype(layer.compute_dtype)
    cache = layer.init_cache(3, 4)
    assert keras.backend.standardize_dtype(cache.keys.dtype) == compute
    assert (
        keras.backend.standardize_dtype(layer.init_cache(3, 4, "float32").keys.dtype) == "float32"
    )
    queries = backend.to_native(sequences(4)["queries"][:, :1])
    _, after = layer(queries, queries, queries, causal=True, cache=cache)
    assert keras.backend.standardize_dtype(after.values.dtype) == compute
    float32_cache = layer.init_cache(3, 4, "float32")
    for keys in (queries, None):
        with pytest.raises(TypeError, match="cache.keys dtype float32 differs"):
            layer(queries, keys, keys, causal=True, cache=float32_cache)


@pytest.mark.usefixtures("eager_flow")
def test_a_step_whose_lengths_hide_no_key_makes_no_mask_on_the_generic_path(monkeypatch):
    """A step of examples at one length, attending over exactly its filled positions
    (Keras on PyTorch's CPU, whose span bucket is 1), gives the generic path no
    lengths: they would hide no key. Where the span is rounded up past them (the
    spec's bucket on TensorFlow and JAX) or the examples differ, it gets them. The
    reference's numbers either way."""
    from mha_multi.keras._facts import FACTS

    weights = grouped_weights(13)
    layer = layer_of(weights)
    x = sequences(13)
    seen = []
    original = type(FACTS).generic_attention

    def recording(self, ops, q, k, v, valid_lens, **kwargs):
        seen.append(valid_lens is None)
        return original(self, ops, q, k, v, valid_lens, **kwargs)

    monkeypatch.setattr(type(FACTS), "generic_attention", recording)
    bucket_of_one = backend.BACKEND == "torch"
    for held in ([3, 3, 3], [3, 1, 2]):
        cache = prefilled(layer, x, held, MAX_LENGTH)
        seen.clear()
        cache, expected_cache = checked_step(layer, weights, x, cache, 3)
        assert_cache_is(cache, expected_cache)
        assert seen == [bucket_of_one and held == [3, 3, 3]]
