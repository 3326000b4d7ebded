"""A plain decoding step on a GPU in PyTorch: the generic path's attention, nothing read.

The facts are told that every tensor is on a GPU: a step reads nothing and
makes no tensor of host data, the rows it writes are checked by the next call
that reads; the generic flow's outputs and cache to the bit, and the float64
reference's numbers.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest
import torch
from cache_support import (
    FLOAT32_ATOL,
    HEAD_DIM,
    HEADS,
    NUM_HIDDENS,
    ROUTE_ROTARY,
    assert_same_decoding,
    feed_back,
    self_attention,
)
from route_support import answered_calls, generic_only

from conftest import recording_host_moves
from mha_multi import spec
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import _facts, _steps


@pytest.mark.parametrize(
    "heads, prompt_length, max_length, options",
    [
        ({"num_heads": 4}, 61, 80, {}),
        (HEADS, 61, 80, {}),
        (HEADS, 300, 400, {}),
        (HEADS, 61, 80, {"rotary": ROUTE_ROTARY[1]}),
        (HEADS, 61, 80, {"rotary": ROUTE_ROTARY[1], "window": 64, "alibi": True}),
        (HEADS, 61, 80, {"softcap": 2.0, "window": 70}),
        (HEADS, 61, 80, {"rotary": ROUTE_ROTARY[1], "qk_norm": {"scope": "whole"}}),
        (HEADS, 61, 80, {"rotary": ROUTE_ROTARY[1], "window": 8, "sinks": True}),
    ],
    ids=[
        "mha",
        "gqa",
        "after a prefill that reads",
        "gqa-rotary",
        "rotary-window-alibi",
        "softcap-window",
        "rotary-norms",
        "rotary-window-sinks",
    ],
)
def test_plain_steps_on_a_gpu_run_the_generic_path_and_read_nothing(
    heads, prompt_length, max_length, options, monkeypatch
):
    """On a GPU a step's finiteness read would wait for the device: the route runs the
    generic path's attention over the filled positions rounded up to the span bucket
    (64, then the whole cache of 80), reading nothing and making no tensor of host data;
    the generic flow's outputs and cache to the bit, and the reference's numbers. A
    prefill of 300 positions reads (its 300 queries see a span of 320, and the scores
    in all that a call recording no gradient reads from are set to its own): its check
    stands for 20 positions more than are filled, and the steps take the route too. A
    rotary layer's steps too, and steps with a window (shorter than the filled positions,
    longer, and filled by the steps), ALiBi, soft-capping, sinks and query/key norms."""
    span = spec.rounded_span(prompt_length, max_length, spec.SPAN_BUCKET)
    prefill_scores = 3 * heads["num_heads"] * prompt_length * span
    monkeypatch.setattr("mha_multi.spec.plan.DEVICE_READ_TOTAL_SCORES", prefill_scores)
    weights, layer = self_attention(heads, seed=13, **options)
    prompt = np.random.default_rng(13).standard_normal((3, prompt_length, NUM_HIDDENS))

    def against_reference(x, before, output):
        expected, _, _ = spec.reference_cached_forward(
            weights, *(x.double().numpy(),) * 3, before, **heads, causal=True, **options
        )
        np.testing.assert_allclose(output.double().numpy(), expected, rtol=0, atol=FLOAT32_ATOL)

    with backend.as_if_on_a_gpu():
        with answered_calls() as answers, backend.kernel_spy() as calls:
            fast, fast_caches = feed_back(layer, prompt, 6, max_length, check=against_reference)
        with generic_only():
            generic, generic_caches = feed_back(layer, prompt, 6, max_length)
        for ours, theirs in zip(fast, generic, strict=True):
            assert torch.equal(ours, theirs)
        for ours, theirs in zip(fast_caches[-1], generic_caches[-1], strict=True):
            assert torch.equal(ours, theirs)
        y = fast[-1]
        with torch.no_grad(), answered_calls() as last, recording_host_moves() as moved:
            layer(y, y, y, causal=True, cache=fast_caches[-1])
    assert answers == [False] + [True] * 6 and last == [True]
    prefill_reads = spec.reads_values(False, prompt_length, span, total_scores=prefill_scores)
    assert prefill_reads == (prompt_length == 300)
    assert len(calls) == prefill_reads  # the prefill's
    assert moved == []


@pytest.mark.parametrize("new_lens", [None, np.array([61, 50, 7])], ids=["uniform", "ragged"])
def test_steps_on_a_cache_whose_examples_and_heads_lie_apart(new_lens):
    """A cache whose arrays hold each head's examples together (``(H_kv, B, ...)`` in
    memory, transposed) has no view of its examples and heads as one dimension, the
    layout a GPU's step attends in (``CacheCheck.attended``): its steps copy the
    positions they attend over instead, on the route the generic flow's numbers to the
    bit, and the reference's."""
    weights, layer = self_attention(HEADS, seed=21)
    prompt = np.random.default_rng(21).standard_normal((3, 61, NUM_HIDDENS))

    def apart():  # (zeros, known finite as init_cache's are: FACTS.empty_cache)
        keys, values = (torch.zeros(2, 3, 80, HEAD_DIM).transpose(0, 1) for _ in "kv")
        return _facts.FACTS.empty_cache(spec.KVCache(keys, values, torch.zeros(3, dtype=int)))

    def against_reference(x, before, output):
        expected, _, _ = spec.reference_cached_forward(
            weights, *(x.double().numpy(),) * 3, before, **HEADS, causal=True
        )
        np.testing.assert_allclose(output.double().numpy(), expected, rtol=0, atol=FLOAT32_ATOL)

    with backend.as_if_on_a_gpu():
        with answered_calls() as answers:
            fast = feed_back(layer, prompt, 4, 80, new_lens, check=against_reference, cache=apart())
        with generic_only():
            generic = feed_back(layer, prompt, 4, 80, new_lens, cache=apart())
    assert answers == ([] if new_lens is not None else [False]) + [True] * 4  # (lengths: no door)
    with pytest.raises(RuntimeError):  # (no such view: what the steps copy for)
        fast[1][-1].keys.view(-1, 80, HEAD_DIM)
    assert_same_decoding(fast, generic)


def test_a_window_step_after_a_read_leaves_out_the_positions_before_the_window(monkeypatch):
    """After a prefill that reads (every value known finite), a windowed layer's first
    step on a GPU leaves out the positions before its window, rounded down to the span
    bucket (256 of 300), on the route as in the generic flow; the rows it writes stay
    pending, and the steps after it attend over every position. The generic flow's
    outputs and cache to the bit, and the reference's numbers."""
    prompt_length, max_length, window = 300, 400, 8
    span = spec.rounded_span(prompt_length, max_length, spec.SPAN_BUCKET)
    monkeypatch.setattr("mha_multi.spec.plan.DEVICE_READ_TOTAL_SCORES", 3 * 4 * 300 * span)
    options = {"rotary": ROUTE_ROTARY[1], "window": window}
    weights, layer = self_attention(HEADS, seed=18, **options)
    prompt = np.random.default_rng(18).standard_normal((3, prompt_length, NUM_HIDDENS))
    generic_attention = _facts.FACTS.generic_attention

    def against_reference(x, before, output):
        expected, _, _ = spec.reference_cached_forward(
            weights, *(x.double().numpy(),) * 3, before, **HEADS, causal=True, **options
        )
        np.testing.assert_allclose(output.double().numpy(), expected, rtol=0, atol=FLOAT32_ATOL)

    step_attention = _steps.step_attention

    def decode(route):
        attended = []

        def spy(ops, q, k, v, valid_lens, **kwargs):
            attended.append(k.shape[-2])
            return generic_attention(ops, q, k, v, valid_lens, **kwargs)

        def route_spy(q, keys, *args, **kwargs):
            attended.append(keys.shape[-1])  # (transposed: step_attention)
            return step_attention(q, keys, *args, **kwargs)

        with (
            contextlib.nullcontext() if route else generic_only(),
            mock.patch.object(_facts.FACTS, "generic_attention", spy),
            mock.patch.object(_steps, "step_attention", route_spy),
            answered_calls() as answers,
        ):
            outputs, caches = feed_back(layer, prompt, 4, max_length, check=against_reference)
        return outputs, caches[-1], answers, attended

    with backend.as_if_on_a_gpu():
        fast, fast_cache, answers, attended = decode(route=True)
        generic, generic_cache, _, generic_attended = decode(route=False)
    assert answers == [False, True, True, True, True]
    # The keys of each step's generic path, the generic flow's or the route's written
    # out: 320 - 256, then the span of 320.
    assert attended == generic_attended == [320 - 256, 320, 320, 320]
    for ours, theirs in zip([*fast, *fast_cache], [*generic, *generic_cache], strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_gpu_steps_of_other_dtypes_give_the_generic_flows_numbers(dtype):
    """The GPU's step in 16 and 64 bits: bfloat16 scores and softmax in float32 and the
    weights rounded once, float64 throughout; the generic flow's outputs and cache to the
    bit, and in float64 the reference's numbers."""
    weights, layer = self_attention(HEADS, seed=19, dtype=dtype, rotary=ROUTE_ROTARY[1])
    prompt = np.random.default_rng(19).standard_normal((3, 5, NUM_HIDDENS))

    def feed(steps):
        with torch.no_grad():
            x = torch.from_numpy(prompt).to(dtype)
            y, cache = layer(x, x, x, causal=True, cache=layer.init_cache(3, 80))
            outputs, befores = [y], []
            y = y[:, -1:]
            for _ in range(steps):
                befores.append(spec.KVCache(*(t.double().numpy().copy() for t in cache)))
                y, cache = layer(y, y, y, causal=True, cache=cache)
                outputs.append(y)
        return outputs, cache, befores

    with backend.as_if_on_a_gpu():
        with answered_calls() as answers:
            fast, fast_cache, befores = feed(4)
        with generic_only():
            generic, generic_cache, _ = feed(4)
    assert answers == [False] + [True] * 4
    for ours, theirs in zip([*fast, *fast_cache], [*generic, *generic_cache], strict=True):
        assert torch.equal(ours, theirs)
    if dtype == torch.float64:
        for before, x, output in zip(befores, fast[:-1], fast[1:], strict=True):
            step_input = x[:, -1:].numpy()
            expected, _, _ = spec.reference_cached_forward(
                weights, *(step_input,) * 3, before, **HEADS, causal=True, rotary=ROUTE_ROTARY[1]
            )
            np.testing.assert_allclose(output.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_the_rows_gpu_steps_write_are_checked_by_the_next_call_that_reads():
    """Steps on a GPU read nothing, a NaN's included (the reference's NaN rows): the rows
    they write stay pending, and the first call that reads (a step on the host) checks
    them all at once. A NaN among them sends it to the generic path, not to SDPA."""
    weights, layer = self_attention(HEADS, seed=14)
    prompt = np.random.default_rng(14).standard_normal((3, 4, NUM_HIDDENS))

    def step(cache, x):
        before = spec.KVCache(*(t.numpy().copy() for t in cache))
        output, cache = layer(x, x, x, causal=True, cache=cache)
        expected, _, _ = spec.reference_cached_forward(
            weights, *(x.double().numpy(),) * 3, before, **HEADS, causal=True
        )
        np.testing.assert_allclose(
            output.double().numpy(), expected, rtol=0, atol=FLOAT32_ATOL, equal_nan=True
        )
        return output, cache

    x = torch.full((3, 1, NUM_HIDDENS), 0.5)
    x[1, 0, 3] = np.nan
    z = x[[0]].expand(3, 1, -1)
    with backend.as_if_on_a_gpu():
        _, caches = feed_back(layer, prompt, 1, 12)
        with answered_calls() as answers, torch.no_grad():
            output, cache = step(caches[-1], x)
            assert torch.isnan(output[1]).all() and torch.isfinite(output[[0, 2]]).all()
            for _ in range(3):
                output, cache = step(cache, z)
    assert answers == [True] * 4
    assert torch.isnan(output[1]).all() and torch.isfinite(output[[0, 2]]).all()
    with answered_calls() as answers, backend.kernel_spy() as calls, torch.no_grad():
        output, cache = step(cache, z)
    assert answers == [False] and calls == []
    assert torch.isnan(output[1]).all() and torch.isfinite(output[[0, 2]]).all()
