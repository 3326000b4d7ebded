"""The imperative layer's plans of plain self-attention: made once per signature, reused.

A call whose queries are its keys and values, and that asks for nothing
else, of an imperative layer recording nothing (or a hybridized layer's
decoding step) runs the plan of its signature (docs: "Fast paths"): a second
call reuses it, with the float64 reference's numbers and the generic flow's to
the bit (and, recorded, its gradients); another signature makes its own; a
decoding step still reads its lengths at every call.
"""

from __future__ import annotations

import contextlib
import itertools
from unittest import mock

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd
from mxnet_support import exported

from mha_multi import spec
from mha_multi.bench.mxnet import FRAMEWORK
from mha_multi.mxnet import KVCache, MultiHeadAttention, _facts, set_weights
from mha_multi.mxnet._plain import plans_of
from mha_multi.weights import init_weights

HEADS = {"num_heads": 4, "num_kv_heads": 2}
ROTARY = {"theta": 100.0}
ATOL = 5e-6


def layer_and_weights(seed, rotary=None):
    weights = init_weights(16, seed=seed, bias=True, **HEADS)
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, rotary=rotary)
    return set_weights(layer, weights), weights


def native(x):
    return mx.np.array(x, dtype=np.float32)


def generic_only():
    """No plan answering: every call takes the generic flow."""
    return mock.patch.object(_facts.MXNetFacts, "plain_attention", lambda *_, **__: None)


@pytest.mark.parametrize("rotary", [None, ROTARY], ids=["plain", "rotary"])
def test_a_second_call_reuses_its_plan_and_another_signature_makes_its_own(rotary):
    layer, weights = layer_and_weights(3, rotary)
    x = np.random.default_rng(3).standard_normal((2, 5, 16))
    options = {} if rotary is None else {"rotary": rotary}

    def call(length, causal):
        rows = native(x[:, :length])
        got = layer(rows, rows, rows, causal=causal).asnumpy()
        expected, _ = spec.reference_forward(
            weights, *[x[:, :length]] * 3, **HEADS, causal=causal, **options
        )
        np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
        with generic_only():
            generic = layer(rows, rows, rows, causal=causal).asnumpy()
        np.testing.assert_array_equal(got, generic)
        return got

    first = call(5, causal=True)
    (plan,) = plans_of(layer).values()
    assert plan is not None and plan.mask_lengths is not None  # causal over 5 positions
    np.testing.assert_array_equal(call(5, causal=True), first)
    assert [id(p) for p in plans_of(layer).values()] == [id(plan)]
    call(1, causal=True)
    call(5, causal=False)
    plans = list(plans_of(layer).values())
    assert len(plans) == 3 and plans[0] is plan and None not in plans


def test_decoding_steps_run_their_plan_and_still_read_the_lengths():
    layer, weights = layer_and_weights(4, ROTARY)
    x = np.random.default_rng(4).standard_normal((2, 6, 16))
    cache = layer.init_cache(2, 6)
    expected_cache = spec.KVCache(np.zeros((2, 2, 6, 4)), np.zeros((2, 2, 6, 4)), np.zeros(2))
    for start, stop in ((0, 2), (2, 3), (3, 4), (4, 5)):
        rows = native(x[:, start:stop])
        output, written = layer(rows, rows, rows, causal=True, cache=cache)
        assert written.keys is cache.keys and written.values is cache.values  # in place
        expected, _, expected_cache = spec.reference_cached_forward(
            weights, *[x[:, start:stop]] * 3, expected_cache, **HEADS, causal=True, rotary=ROTARY
        )
        np.testing.assert_allclose(output.asnumpy(), expected, rtol=0, atol=ATOL)
        cache = written
    steps = [p for p in plans_of(layer).values() if p is not None and p.max_length == 6]
    assert len(steps) == 1  # the prompt's causal chunk takes the generic flow; the steps one plan
    assert cache.lengths.asnumpy().tolist() == [5, 5]

    # Lengths of the same signature are read again: a full cache is refused,
    # nothing written; ragged lengths take the plan too, with the reference's numbers.
    rows = native(x[:, 5:6])
    before = [array.asnumpy() for array in cache]
    full = KVCache(cache.keys, cache.values, mx.np.array([6, 5], dtype=np.int32))
    with pytest.raises(ValueError, match="overflows"):
        layer(rows, rows, rows, causal=True, cache=full)
    np.testing.assert_array_equal(cache.keys.asnumpy(), before[0])
    ragged = KVCache(cache.keys, cache.values, mx.np.array([5, 3], dtype=np.int32))
    held = spec.KVCache(before[0], before[1], np.array([5, 3]))
    output, _ = layer(rows, rows, rows, causal=True, cache=ragged)
    expected, _, _ = spec.reference_cached_forward(
        weights, *[x[:, 5:6]] * 3, held, **HEADS, causal=True, rotary=ROTARY
    )
    np.testing.assert_allclose(output.asnumpy(), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("rotary", [None, ROTARY], ids=["plain", "rotary"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_recorded_call_runs_its_plan_to_the_generic_gradients(causal, rotary):
    """A call without a cache under ``autograd.record()`` (no dropout) runs its plan: its
    output and the gradients of the input and of every parameter the generic flow's
    to the bit, and the float64 reference's."""
    layer, weights = layer_and_weights(6, rotary)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 5, 16))
    output_gradient = rng.standard_normal((2, 5, 16))
    options = {} if rotary is None else {"rotary": rotary}
    expected, _ = spec.reference_forward(weights, x, x, x, **HEADS, causal=causal, **options)
    reference = spec.reference_gradients(
        weights, x, x, x, **HEADS, causal=causal, output_gradient=output_gradient, **options
    )
    runs = []
    for route in (contextlib.nullcontext(), generic_only()):
        rows = native(x)
        rows.attach_grad()
        with route, autograd.record():
            output = layer(rows, rows, rows, causal=causal)
        output.backward(native(output_gradient))
        parameters = layer.collect_params()
        gradients = {name: p.grad().asnumpy() for name, p in parameters.items()}
        runs.append((output.asnumpy(), rows.grad.asnumpy(), gradients))
    assert len(plans_of(layer)) == 1
    (output, inputs_gradient, gradients), generic = runs
    np.testing.assert_array_equal(output, generic[0])
    np.testing.assert_array_equal(inputs_gradient, generic[1])
    for name, gradient in gradients.items():
        np.testing.assert_array_equal(gradient, generic[2][name], err_msg=name)
    np.testing.assert_allclose(output, expected, rtol=0, atol=ATOL)
    inputs = reference["queries"] + reference["keys"] + reference["values"]
    np.testing.assert_allclose(inputs_gradient, inputs, rtol=0, atol=5e-5)
    for name, gradient in gradients.items():
        # (MXNet's own names: a prefix, then W_q_weight, W_q_bias, ...)
        which, kind = name.rsplit("_", 2)[1:]
        want = reference[f"W_{which}"].T if kind == "weight" else reference[f"b_{which}"]
        np.testing.assert_allclose(gradient, want, rtol=0, atol=5e-5, err_msg=name)


@pytest.mark.parametrize("rotary", [None, ROTARY], ids=["plain", "rotary"])
@pytest.mark.parametrize("num_new", [1, 2])
def test_a_ragged_batchs_steps_run_their_plan_to_the_generic_flows_bits(num_new, rotary):
    """Examples holding different lengths each write their rows at their own position
    and attend over their own keys: the plan's output and cache are the generic
    flow's to the bit, the float64 reference's within float32 rounding, and a stale
    NaN or infinity past an example's length reaches its output as in both
    (a hidden value's weight is 0). Several new positions a step: without the
    causal rule, as the plan takes them."""
    layer, weights = layer_and_weights(8, rotary)
    rng = np.random.default_rng(8)
    options = {} if rotary is None else {"rotary": rotary}
    causal = num_new == 1
    max_length = 24
    keys, values = (rng.standard_normal((3, 2, max_length, 4)) for _ in range(2))
    keys[2, 1, 9], values[2, 0, 10] = np.inf, np.nan  # stale rows past example 2's length
    lengths = np.array([6, 11, 3])
    steps = [rng.standard_normal((3, num_new, 16)) for _ in range(4)]
    caches = {}
    # The plan writes no row through the generic flow's write.
    no_generic_write = mock.patch.object(
        _facts.MXNetFacts, "write_cache", side_effect=AssertionError("the generic flow's write")
    )
    for name, route in (("plan", no_generic_write), ("generic", generic_only())):
        cache = KVCache(native(keys), native(values), mx.np.array(lengths, dtype=np.int32))
        expected_cache = spec.KVCache(keys, values, lengths)
        outputs = []
        for x in steps:
            rows = native(x)
            with route:
                output, written = layer(rows, rows, rows, causal=causal, cache=cache)
            assert written.keys is cache.keys and written.values is cache.values  # in place
            expected, _, expected_cache = spec.reference_cached_forward(
                weights, x, x, x, expected_cache, **HEADS, causal=causal, **options
            )
            got = output.asnumpy()  # (NaN where the reference has NaN: allclose's equal_nan)
            np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
            outputs.append(got)
            cache = written
        caches[name] = (outputs, [a.asnumpy() for a in cache])
    assert np.isnan(caches["plan"][0][0][2]).all()  # the stale NaN reached example 2
    plans = [p for p in plans_of(layer).values() if p is not None and p.max_length == max_length]
    assert len(plans) == 1
    for got, want in zip(caches["plan"][0], caches["generic"][0], strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(caches["plan"][1], caches["generic"][1], strict=True):
        np.testing.assert_array_equal(got, want)
    assert caches["plan"][1][2].tolist() == (lengths + 4 * num_new).tolist()


#: Layers whose options the plans take: query/key norms (Qwen 3's per head, Gemma 3's
#: ``1 + w``, OLMo 2's of the whole projection), a window, a soft cap (Gemma 2's, small
#: enough to act), sinks (gpt-oss') and ALiBi (BLOOM's), with and without rotary.
OPTIONS = {
    "norms": {"qk_norm": {}},
    "rotary, norms 1 + w": {"rotary": ROTARY, "qk_norm": {"unit_offset": True}},
    "whole norms": {"qk_norm": {"scope": "whole"}},
    "rotary, window": {"rotary": ROTARY, "window": 7},
    "rotary, window, norms": {"rotary": ROTARY, "window": 7, "qk_norm": {}},
    "soft cap": {"softcap": 3.0},
    "rotary, window, soft cap": {"rotary": ROTARY, "window": 7, "softcap": 3.0},
    "rotary, sinks": {"rotary": ROTARY, "sinks": True},
    "window, sinks": {"window": 7, "sinks": True},
    "ALiBi": {"alibi": True},
    "ALiBi, window, soft cap": {"alibi": True, "window": 7, "softcap": 3.0},
}


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
def test_a_layer_with_options_runs_its_plan_to_the_generic_flows_bits(options):
    """A call without a cache (a window's takes the generic flow: its mask), recorded
    or not, and decoding steps, uniform and ragged, on the plan: the generic flow's
    outputs, gradients and caches to the bit, the float64 reference's within float32
    rounding; a step whose keys the window hides takes the generic flow. A soft cap,
    sinks and ALiBi take the generic path's attention, called as the generic flow
    calls it (ALiBi's query positions a step's own)."""
    rng = np.random.default_rng(10)
    weights = init_weights(16, seed=10, bias=True, sinks=options.get("sinks", False), **HEADS)
    norm = spec.QKNorm(**options["qk_norm"]) if "qk_norm" in options else None
    if norm is not None:  # (norms away from their start, so that they act)
        shapes = norm.shapes(spec.Heads(4, 2, 4))
        weights |= {n: rng.uniform(0.5, 1.5, shape) for n, shape in shapes.items()}
    layer = set_weights(MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, **options), weights)
    x = rng.standard_normal((2, 5, 16))
    grad = rng.standard_normal((2, 5, 16))
    steps = [rng.standard_normal((2, 1, 16)) for _ in range(5)]
    runs = []
    # The generic flow's writes of the cache, counted: the steps the plan leaves to it.
    counted = mock.patch.object(
        _facts.MXNetFacts, "write_cache", autospec=True, side_effect=_facts.MXNetFacts.write_cache
    )
    for route in (counted, generic_only()):
        with route as spy:
            rows = native(x)
            rows.attach_grad()
            with autograd.record():
                recorded = layer(rows, rows, rows, causal=True)
            recorded.backward(native(grad))
            outputs = [recorded.asnumpy(), rows.grad.asnumpy()]
            for lengths in ([3, 3], [4, 1]):  # uniform, then ragged
                cache = layer.init_cache(2, 9)
                cache = KVCache(cache.keys, cache.values, mx.np.array(lengths, dtype=np.int32))
                for step in steps:  # the window of 7 holds the first 3 steps' keys, then hides
                    step_rows = native(step)
                    output, cache = layer(step_rows, step_rows, step_rows, causal=True, cache=cache)
                    outputs.append(output.asnumpy())
                outputs += [a.asnumpy() for a in cache]
            if not runs:  # (a window of 7: the last step of the uniform batch, the last two
                # of the ragged one, see keys it hides)
                assert spy.call_count == (3 if "window" in options else 0)
        runs.append(outputs)
    plans = [p for p in plans_of(layer).values() if p is not None]
    assert len(plans) == (1 if "window" in options else 2)  # (no plan of a window's call)
    for got, want in zip(*runs, strict=True):
        np.testing.assert_array_equal(got, want)
    expected, _ = spec.reference_forward(weights, x, x, x, **HEADS, causal=True, **options)
    np.testing.assert_allclose(runs[0][0], expected, rtol=0, atol=ATOL)


#: Lengths of three examples of 5 positions: integers (one example fully hidden, one
#: past its positions), fractional floats, floats that hide every key or none, and one
#: length a query.
LENGTHS = {
    "int32": np.array([3, 0, 7], dtype=np.int32),
    "float32": np.array([2.5, 5.0, 0.0], dtype=np.float32),
    "NaN, inf, negative": np.array([np.nan, np.inf, -1.0], dtype=np.float32),
    "per query": np.array([[1, 2, 3, 4, 5], [0, 0, 1, 1, 5], [5, 4, 3, 2, 1]], dtype=np.int32),
}


@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("options", [{}, {"rotary": ROTARY}, {"softcap": 3.0}], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_a_call_with_lengths_runs_its_plan_to_the_generic_flows_bits(lengths, options, causal):
    """d2l's call, self-attention with ``valid_lens``, recorded or not: the plan's output
    and gradients are the generic flow's to the bit (its kernel call, or with a soft cap
    its generic path, given the same lengths), the float64 reference's within float32
    rounding (a fully hidden row uniform over its keys, as the spec has it)."""
    rng = np.random.default_rng(11)
    weights = init_weights(16, seed=11, bias=True, **HEADS)
    layer = set_weights(MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, **options), weights)
    x = rng.standard_normal((3, 5, 16))
    grad = rng.standard_normal((3, 5, 16))
    lens = mx.np.array(LENGTHS[lengths], dtype=LENGTHS[lengths].dtype)
    runs = []
    for route in (contextlib.nullcontext(), generic_only()):
        with route:
            rows = native(x)
            plain = layer(rows, rows, rows, lens, causal=causal).asnumpy()
            rows.attach_grad()
            with autograd.record():
                recorded = layer(rows, rows, rows, lens, causal=causal)
            recorded.backward(native(grad))
        runs.append([plain, recorded.asnumpy(), rows.grad.asnumpy()])
    assert len([p for p in plans_of(layer).values() if p is not None]) == 1
    for got, want in zip(*runs, strict=True):
        np.testing.assert_array_equal(got, want)
    expected, _ = spec.reference_forward(
        weights, x, x, x, LENGTHS[lengths], **HEADS, causal=causal, **options
    )
    np.testing.assert_allclose(runs[0][0], expected, rtol=0, atol=ATOL)


def test_hybridized_and_recorded_cached_calls_keep_no_plan():
    """A hybridized call and a recorded call with a cache keep no plan: the generic
    flow's, with the reference's numbers. (A dropping call keeps one:
    ``test_mxnet_plan_dropout``.)"""
    layer, weights = layer_and_weights(5)
    rows = native(np.random.default_rng(5).standard_normal((1, 3, 16)))
    with autograd.record():
        layer(rows, rows, rows, cache=layer.init_cache(1, 4))
    assert plans_of(layer) == {}
    expected, _ = spec.reference_forward(weights, *[rows.asnumpy()] * 3, **HEADS)
    layer.hybridize()
    output = layer(rows, rows, rows)
    assert plans_of(layer) == {}
    np.testing.assert_allclose(output.asnumpy(), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
def test_a_hybridized_layers_decoding_steps_run_their_plan_and_export_their_graph(
    ragged, tmp_path, monkeypatch
):
    """A hybridized layer without options decodes one token per example by its plan, as
    an imperative one does (a step's rows are written outside any graph either way):
    the imperative layer's numbers and the generic flow's to the bit, the reference's
    within ``ATOL``, over spans rounded up to ``spec.SPAN_BUCKET`` (across a bucket's
    edge: a prefix of the cache, then all of it); its prompt, a causal chunk, runs its
    graph. ``export`` after such a step writes the step's functional graph, which gives
    the step's output and cache."""
    spans = []  # (every prefix of the cache a call attends over: one bucket's)
    prefix = _facts.MXNetFacts.cache_prefix

    def spying(facts, keys, values, span, first=0):
        spans.append(span)
        return prefix(facts, keys, values, span, first)

    monkeypatch.setattr(_facts.MXNetFacts, "cache_prefix", spying)
    layer, weights = layer_and_weights(11)
    twin, _ = layer_and_weights(11)
    layer.hybridize()
    max_length, prompt = spec.SPAN_BUCKET + 6, spec.SPAN_BUCKET - 4
    lengths = [prompt, prompt - 3] if ragged else [prompt, prompt]
    positions = range(prompt, max_length - 1)
    x = np.random.default_rng(11).standard_normal((2, max_length, 16))
    runs = []
    for each, route in ((layer, None), (twin, None), (twin, generic_only())):
        with route or contextlib.nullcontext():
            rows = native(x[:, :prompt])
            lens = mx.np.array(lengths, dtype=np.int32) if ragged else None
            empty = each.init_cache(2, max_length)
            _, cache = each(rows, rows, rows, lens, causal=True, cache=empty)
            outputs = []
            for position in positions:
                before = cache
                step = native(x[:, position : position + 1])
                output, cache = each(step, step, step, causal=True, cache=cache)
                assert cache.keys is before.keys  # (written in place)
                outputs.append(output.asnumpy())
        runs.append((outputs, [a.asnumpy() for a in cache]))
    assert set(spans) == {spec.SPAN_BUCKET}
    for (outputs, held), (other_outputs, other_held) in itertools.pairwise(runs):
        for got, want in zip(outputs + held, other_outputs + other_held, strict=True):
            np.testing.assert_array_equal(got, want)
    outputs, held = runs[0]
    steps = [p for p in plans_of(layer).values() if p is not None and p.max_length == max_length]
    assert len(steps) == 1
    expected_cache = spec.KVCache(*[np.zeros((2, 2, max_length, 4))] * 2, np.zeros(2))
    _, _, expected_cache = spec.reference_cached_forward(
        weights, *[x[:, :prompt]] * 3, expected_cache, np.array(lengths), **HEADS, causal=True
    )
    for position, output in zip(positions, outputs, strict=True):
        rows = x[:, position : position + 1]
        expected, _, expected_cache = spec.reference_cached_forward(
            weights, rows, rows, rows, expected_cache, **HEADS, causal=True
        )
        np.testing.assert_allclose(output, expected, rtol=0, atol=ATOL)

    graph, _ = exported(layer, tmp_path)
    lengths = mx.np.array(held[2] - 1, dtype=np.int32)
    earlier = [mx.np.array(a, dtype=np.float32) for a in held[:2]]  # (the row rewritten)
    step = native(x[:, positions[-1] : positions[-1] + 1])
    ones = mx.np.array([1, 1], dtype=np.int32)
    output, *updated = graph(step, step, step, ones, *earlier, lengths)
    np.testing.assert_allclose(output.asnumpy(), outputs[-1], rtol=0, atol=ATOL)
    for got, want in zip(updated, held, strict=True):
        np.testing.assert_allclose(got.asnumpy(), want, rtol=0, atol=ATOL)


def test_a_hybridized_rotary_layer_runs_its_plan_to_the_generic_flows_bits():
    """A hybridized layer with rotary positions runs its calls on its arrays (a graph
    takes no host constant): its plan's, the generic flow's to the bit, a call without
    a cache and a ragged batch's decoding steps alike."""
    layer, weights = layer_and_weights(9, ROTARY)
    layer.hybridize()
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 5, 16))
    lengths = mx.np.array([5, 2], dtype=np.int32)
    runs = []
    for route in (contextlib.nullcontext(), generic_only()):
        with route:
            rows = native(x)
            outputs = [layer(rows, rows, rows, causal=True).asnumpy()]
            cache = KVCache(layer.init_cache(2, 8).keys, layer.init_cache(2, 8).values, lengths)
            for position in range(2):
                step = native(x[:, position : position + 1])
                output, cache = layer(step, step, step, causal=True, cache=cache)
                outputs.append(output.asnumpy())
        runs.append((outputs, [a.asnumpy() for a in cache]))
    assert len([p for p in plans_of(layer).values() if p is not None]) == 2
    (outputs, cache), (generic_outputs, generic_cache) = runs
    for got, want in zip(outputs + cache, generic_outputs + generic_cache, strict=True):
        np.testing.assert_array_equal(got, want)
    expected, _ = spec.reference_forward(weights, x, x, x, **HEADS, causal=True, rotary=ROTARY)
    np.testing.assert_allclose(outputs[0], expected, rtol=0, atol=ATOL)


def test_the_benchs_training_call_records_its_plan():
    """The bench's count of a training call (``python -m mha_multi.bench run --only calls
    mxnet``): an imperative call recorded by ``autograd.record()``, which its plan runs
    and whose output a gradient flows back through."""

    layer, weights = layer_and_weights(7)
    layer.hybridize()
    rows = native(np.random.default_rng(7).standard_normal((1, 1, 16)))
    rows.attach_grad()
    output = FRAMEWORK.eager_layer_call(layer, training=True)(rows)
    output.backward()
    assert len(plans_of(layer)) == 1 and float(abs(rows.grad).sum()) > 0
    expected, _ = spec.reference_forward(weights, *[rows.asnumpy()] * 3, **HEADS)
    np.testing.assert_allclose(output.asnumpy(), expected, rtol=0, atol=ATOL)
