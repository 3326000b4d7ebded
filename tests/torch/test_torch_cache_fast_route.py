"""A plain decoding step's fast route in PyTorch: the generic flow's outputs, cache and errors.

Self-attention steps under ``no_grad`` are answered by the facts' route where
it can, with the generic flow's outputs and cache to the bit and the float64
reference's numbers; what it declines, and every error, is the generic
flow's. The GPU's steps are ``test_torch_cache_gpu_steps.py``'s.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import itertools
import weakref
from unittest import mock

import numpy as np
import pytest
import torch
from cache_support import (
    FLOAT32_ATOL,
    HEADS,
    NUM_HIDDENS,
    ROUTE_ROTARY,
    assert_same_decoding,
    feed_back,
    self_attention,
    tensors,
)
from route_support import answered_calls, generic_only

from mha_multi import spec
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import _cache, _facts, _steps, set_weights


@pytest.mark.parametrize("finite_from", [None, 3, 9])
@pytest.mark.parametrize("key_upto", [0, 2, 9])
@pytest.mark.parametrize("pending", [False, True])
def test_a_steps_check_is_the_one_attach_and_written_past_make(finite_from, key_upto, pending):
    """``CacheCheck.stepped``, a plain step's shortcut, leaves the check that attaching
    a new one and carrying over what the prior knew (``written_past``) leave, field by
    field: what the next step and every later call trust."""
    keys, values, before = torch.zeros(2, 1, 9, 4), torch.zeros(2, 1, 9, 4), torch.full((2,), 4)
    prior = _cache.CacheCheck.attach(
        spec.KVCache(keys, values, before), None, 4, np.full(2, 4), pending=None
    )
    prior.finite_from, prior.key_upto, prior.key_max = finite_from, key_upto, 2.5
    prior.step = "the plan before"
    keys[:, :, 4] = values[:, :, 4] = 1.0  # the step's rows
    kept = {
        "poison": torch.zeros(()) if pending else None,
        "pending": (keys[:, :, 4:5], values[:, :, 4:5]) if pending else None,
    }

    def updated():
        return spec.KVCache(keys, values, torch.full((2,), 5))

    slow_cache, fast_cache = updated(), updated()
    slow = _cache.CacheCheck.attach(
        slow_cache, kept["poison"], 5, prior.lengths, pending=kept["pending"], added=1
    )
    slow.step, slow._uniform = "this plan", 5
    slow.written_past(prior, 4, 5)
    fast = prior.stepped(fast_cache, 5, "this plan", before, **kept)
    # (The arrays, poison and pending rows are the same objects in both: compared by identity;
    # each check carried by its own lengths.)
    own = ("keys", "values", "carrier", "key", "lengths_address")
    fields = {name: value for name, value in vars(slow).items() if name not in own}
    assert {name: value for name, value in vars(fast).items() if name in fields} == fields
    assert vars(fast).keys() == vars(slow).keys()
    assert fast.keys() is keys and fast.values() is values
    assert _cache.carried_check(fast_cache.lengths) is fast
    assert _cache.carried_check(slow_cache.lengths) is slow
    assert fast.lengths_address == fast_cache.lengths.data_ptr()
    assert fast.key == id(fast_cache.lengths)
    assert fast.lengths.tolist() == [5, 5] and fast.uniform == 5
    # The lengths before carry no check: a call given them again reads them.
    assert _cache.CacheCheck.of(spec.KVCache(keys, values, before)) is None
    assert _cache.CacheCheck.host_lengths(before) is None


@pytest.mark.parametrize("written", ["nan", "finite"])
def test_a_cache_rewound_past_written_rows_gives_the_spec_numbers(written):
    """Rows written in place stay past the lengths of an older cache of the same
    tensors. A call of that cache attends over its filled positions only where the
    values past them read finite: a NaN row there gives the spec's NaN (a hidden
    value's weight of 0 times NaN). Finite rows cost the call that one read, and the
    step after takes the route again."""
    weights, layer = self_attention(HEADS, 31)
    rng = np.random.default_rng(31)
    x, y, z, w = (rng.standard_normal((3, n, NUM_HIDDENS)).astype(np.float32) for n in (3, 1, 1, 1))
    second = y.copy()
    if written == "nan":
        second[0, 0, 0] = np.nan

    def step(inputs, cache):
        before = spec.KVCache(*(t.numpy().copy() for t in cache))
        (t,) = tensors(inputs)  # one tensor: self-attention, which the route may take
        with torch.no_grad():
            output, cache = layer(t, t, t, causal=True, cache=cache)
        expected, _, _ = spec.reference_cached_forward(
            weights, inputs, inputs, inputs, before, **HEADS, causal=True
        )
        np.testing.assert_array_equal(np.isnan(output.numpy()), np.isnan(expected))
        np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)
        return expected, cache

    with torch.no_grad():
        _, rewound = layer(*tensors(x, x, x), causal=True, cache=layer.init_cache(3, 9))
    _, cache = step(y, rewound)  # position 3
    _, cache = step(second, cache)  # position 4
    with answered_calls() as answers:
        expected, cache = step(z, rewound)  # position 3 again: position 4 is past the span
        step(w, cache)  # position 4 overwritten
    assert np.isnan(expected[0]).all() == (written == "nan")
    assert np.isfinite(expected[1:]).all()
    # (A chain that met a NaN stays on the generic flow: its check cannot tell when
    # the row is overwritten.)
    assert answers == [False, written == "finite"]


@pytest.mark.parametrize(
    "dtype, heads, rotary",
    [
        (torch.float32, {"num_heads": 4}, None),
        (torch.float32, HEADS, None),
        (torch.float64, HEADS, None),
        (torch.float32, HEADS, ROUTE_ROTARY[1]),
        (torch.float64, {"num_heads": 4}, ROUTE_ROTARY[2]),
    ],
    ids=["mha", "gqa", "gqa-float64", "gqa-rotary", "mha-interleaved-float64"],
)
def test_plain_decoding_steps_take_the_fast_route_to_the_generic_numbers(heads, dtype, rotary):
    """Self-attention steps under ``no_grad``, all examples at one length: the facts answer
    every step after the prefill, with the generic flow's outputs and cache to the bit, and
    the float64 reference's numbers; a layer whose one option is rotary too (its rows
    rotated at each example's length)."""
    weights, layer = self_attention(heads, seed=11, dtype=dtype, rotary=rotary)
    prompt = np.random.default_rng(11).standard_normal((3, 4, NUM_HIDDENS))
    atol = FLOAT32_ATOL if dtype == torch.float32 else 1e-12

    def against_reference(x, before, output):
        expected, _, _ = spec.reference_cached_forward(
            weights, *(x.double().numpy(),) * 3, before, **heads, causal=True, rotary=rotary
        )
        np.testing.assert_allclose(output.double().numpy(), expected, rtol=0, atol=atol)

    with answered_calls() as answers:
        fast, fast_caches = feed_back(layer, prompt, 6, 12, check=against_reference)
    assert answers == [False] + [True] * 6  # the prefill of 4 positions is no step
    with generic_only():
        generic, generic_caches = feed_back(layer, prompt, 6, 12)
    for ours, theirs in zip(fast, generic, strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(fast_caches[-1], generic_caches[-1], strict=True):
        assert torch.equal(ours, theirs)
    assert all(cache.keys is fast_caches[0].keys for cache in fast_caches)
    assert fast_caches[-1].lengths.tolist() == [10, 10, 10]


#: Layers whose steps the route takes with what they do to the scores.
SCORE_OPTIONS = {
    "window": {"window": 3},
    "alibi": {"alibi": True},
    "softcap": {"softcap": 2.0},
    "rotary-window-alibi-softcap": {
        "rotary": ROUTE_ROTARY[1],
        "window": 4,
        "alibi": True,
        "softcap": 3.0,
    },
    "window-alibi": {"window": 2, "alibi": True},
    # Windows the first steps fill (the generic flow plans those without them).
    "window-crossed-alibi": {"window": 6, "alibi": True},
    "window-crossed-softcap": {"window": 7, "softcap": 2.0},
    # gpt-oss's sinks (with its window), and sinks alone.
    "rotary-window-sinks": {"rotary": ROUTE_ROTARY[1], "window": 3, "sinks": True},
    "sinks": {"sinks": True},
    # Qwen 3's and OLMo 2's norms (of each head, of the whole projection), Gemma 3's.
    "rotary-norms": {"rotary": ROUTE_ROTARY[1], "qk_norm": {"eps": 1e-6}},
    "norms-whole": {"qk_norm": {"scope": "whole", "product": "float32"}},
    "rotary-window-norms": {
        "rotary": ROUTE_ROTARY[2],
        "window": 3,
        "qk_norm": {"unit_offset": True, "eps": 1e-6},
    },
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("options", SCORE_OPTIONS.values(), ids=SCORE_OPTIONS.keys())
def test_steps_of_layers_with_score_options_take_the_route_to_the_generic_numbers(options, dtype):
    """A window, ALiBi, soft-capping, sinks and query/key norms, alone and together with
    rotary positions: the route answers every step after the prefill (SDPA with the
    window's mask and ALiBi's bias, or the generic path's operations where a cap or
    sinks keep the kernel out), with the generic flow's outputs and cache to the bit and
    the float64 reference's numbers; a window shorter than the filled positions, and one
    the steps fill (planned without it until then, as the generic flow plans them)."""
    weights, layer = self_attention(HEADS, seed=23, dtype=dtype, **options)
    prompt = np.random.default_rng(23).standard_normal((3, 4, NUM_HIDDENS))
    atol = FLOAT32_ATOL if dtype == torch.float32 else 1e-12

    def against_reference(x, before, output):
        expected, _, _ = spec.reference_cached_forward(
            weights, *(x.double().numpy(),) * 3, before, **HEADS, causal=True, **options
        )
        np.testing.assert_allclose(output.double().numpy(), expected, rtol=0, atol=atol)

    with answered_calls() as answers:
        fast = feed_back(layer, prompt, 6, 12, check=against_reference)
    assert answers == [False] + [True] * 6
    with generic_only():
        assert_same_decoding(fast, feed_back(layer, prompt, 6, 12))
    assert all(cache.keys is fast[1][0].keys for cache in fast[1])


@pytest.mark.parametrize("options", SCORE_OPTIONS.values(), ids=SCORE_OPTIONS.keys())
def test_16_bit_steps_with_score_options_give_the_generic_flows_numbers(options):
    """In 16 bits the host's steps take SDPA through float32 copies, which the route does
    not: soft-capped steps and those with sinks (no kernel takes them) take the route's
    generic operations, the others the generic flow; the generic flow's outputs and cache
    to the bit either way."""
    _, layer = self_attention(HEADS, seed=37, dtype=torch.float16, **options)
    prompt = np.random.default_rng(37).standard_normal((3, 4, NUM_HIDDENS))
    with answered_calls() as answers:
        fast = feed_back(layer, prompt, 4, 12)
    takes_16_bit = options.get("softcap") is not None or options.get("sinks", False)
    assert answers == [False] + [takes_16_bit] * 4
    with generic_only():
        assert_same_decoding(fast, feed_back(layer, prompt, 4, 12))


#: How many keys each attention a test spies on attends over, of its arguments: the
#: generic path's ``(ops, q, k, ...)``, SDPA's ``(q, k, ...)``, and a step's transposed
#: keys (:func:`mha_multi.torch._steps.step_attention`).
KEY_COUNTS = {
    "generic_attention": lambda args: args[2].shape[-2],
    "scaled_dot_product_attention": lambda args: args[1].shape[-2],
    "step_attention": lambda args: args[1].shape[-1],
}


@pytest.mark.parametrize(
    "options", [{"alibi": True}, {"softcap": 2.0}], ids=["alibi (SDPA)", "softcap (generic)"]
)
def test_window_steps_attend_over_the_window_where_every_value_before_it_is_finite(options):
    """Past the window, a step attends over the window's positions alone (no key hidden,
    large scores too) where every value before them is known finite (SDPA's steps read
    so; a soft cap's, which no kernel takes, read the rows no call read), on the route and
    in the generic flow alike: their numbers and caches to the bit, and the float64
    reference's. A NaN before the window (which the spec's hidden weight of 0 turns into
    NaN), in the prompt or a step's row, keeps every position: the reference's NaN
    rows."""
    options = {"window": 3, **options}
    weights, layer = self_attention(HEADS, seed=29, **options)
    rng = np.random.default_rng(29)
    prompt = rng.standard_normal((3, 4, NUM_HIDDENS))
    # Inputs of 3e3: keys and queries near 1e4, scores past the fused limit.
    large = torch.full((3, 1, NUM_HIDDENS), 3e3)
    poisoned = prompt.copy()
    poisoned[1, 0, 2] = np.nan  # a NaN value at position 0 of example 1
    nan_step = torch.full((3, 1, NUM_HIDDENS), 0.5)
    nan_step[1, 0, 3] = np.nan
    spied = {  # (KEY_COUNTS: how many keys each attends over)
        torch.nn.functional: "scaled_dot_product_attention",
        _facts.FACTS: "generic_attention",
        _steps: "step_attention",
    }

    def against_reference(x, before, output):
        expected, _, _ = spec.reference_cached_forward(
            weights, *(x.double().numpy(),) * 3, before, **HEADS, causal=True, **options
        )
        np.testing.assert_allclose(
            output.double().numpy(), expected, rtol=1e-5, atol=FLOAT32_ATOL, equal_nan=True
        )

    def decode(prompt, route, tail):
        attended = []  # the keys of each attention: SDPA's, the generic path's, a step's

        def spy(attention, keys_of):
            def counted(*args, **kwargs):
                attended.append(keys_of(args))
                return attention(*args, **kwargs)

            return counted

        with contextlib.ExitStack() as stack:
            if not route:
                stack.enter_context(generic_only())
            for owner, name in spied.items():
                counted = spy(getattr(owner, name), KEY_COUNTS[name])
                stack.enter_context(mock.patch.object(owner, name, counted))
            answers = stack.enter_context(answered_calls())
            stack.enter_context(torch.no_grad())
            outputs, cache = feed_back(layer, prompt, 3, 12, check=against_reference)
            cache = cache[-1]
            for x in tail:
                before = spec.KVCache(*(t.numpy().copy() for t in cache))
                output, cache = layer(x, x, x, causal=True, cache=cache)
                against_reference(x, before, output)
                outputs.append(output)
        return outputs, cache, answers, attended

    # A step of large inputs; a NaN a step writes, which keeps every position after it
    # (its row past the window still turns example 1's rows into NaN).
    tails = {"large": [large], "nan": [nan_step, *[nan_step.nan_to_num()] * 4]}
    for name, tail in tails.items():
        outputs, cache, answers, attended = decode(prompt, route=True, tail=tail)
        # (Past a NaN, SDPA's steps are the generic flow's; a soft cap's the route's.)
        taken = [False] + [True] * (4 if name == "large" else 3)
        assert answers[: len(taken)] == taken
        # The prefill's keys, each step's window (the NaN step's too, read with its
        # rows), then every filled position.
        assert attended == [4] + [3] * 4 + ([] if name == "large" else [9, 10, 11, 12])
        generic_outputs, generic_cache, _, generic_attended = decode(prompt, False, tail)
        assert generic_attended == attended
        ours_all, theirs_all = [*outputs, *cache], [*generic_outputs, *generic_cache]
        for ours, theirs in zip(ours_all, theirs_all, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(outputs[-1][1]).all() and torch.isfinite(outputs[-1][[0, 2]]).all()

    outputs, cache, answers, attended = decode(poisoned, route=True, tail=[])
    assert attended == list(range(4, 8))  # every filled position
    assert all(torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all() for y in outputs)


def test_steps_the_fast_route_declines_take_the_generic_flow():
    """Ragged lengths (whose steps take the route's ragged step), a NaN in a step's input
    and grouped heads all give the reference's numbers, NaN rows where it has them; a
    full cache refuses the next step with the generic flow's error and nothing written."""
    weights, layer = self_attention(HEADS, seed=12)
    prompt = np.random.default_rng(12).standard_normal((3, 4, NUM_HIDDENS))

    def against_reference(x, before, output):
        expected, _, _ = spec.reference_cached_forward(
            weights, *(x.double().numpy(),) * 3, before, **HEADS, causal=True
        )
        np.testing.assert_allclose(
            output.double().numpy(), expected, rtol=0, atol=FLOAT32_ATOL, equal_nan=True
        )

    with answered_calls() as answers:
        _, caches = feed_back(layer, prompt, 3, 8, np.array([4, 2, 3]), check=against_reference)
    # Steps of examples holding 4, 2 and 3 (mha_multi.torch._ragged); the prompt's call,
    # a cached call with lengths, is no step the route is offered.
    assert answers == [True] * 3
    assert caches[-1].lengths.tolist() == [7, 5, 6]

    with answered_calls() as answers, torch.no_grad():
        _, caches = feed_back(layer, prompt, 1, 7)
        cache = caches[-1]
        x = torch.full((3, 1, NUM_HIDDENS), 0.5)
        x[1, 0, 3] = np.nan
        before = spec.KVCache(*(t.numpy().copy() for t in cache))
        output, cache = layer(x, x, x, causal=True, cache=cache)
        against_reference(x, before, output)
        assert torch.isnan(output[1]).all() and torch.isfinite(output[[0, 2]]).all()
        # The NaN row is held now: a later step's keys include it.
        z = x[[0]].expand(3, 1, -1)
        output, cache = layer(z, z, z, causal=True, cache=cache)
    assert answers == [False, True, False, False]  # prefill, step, NaN, NaN held
    assert torch.isnan(output[1]).all() and torch.isfinite(output[[0, 2]]).all()

    with generic_only(), pytest.raises(ValueError) as generic_error, torch.no_grad():
        layer(z, z, z, causal=True, cache=cache)
    full = cache
    before = [t.clone() for t in full]
    y = torch.zeros(3, 1, NUM_HIDDENS)
    overflow = pytest.raises(ValueError, match="overflows: example 0 would hold 8")
    with overflow as error, torch.no_grad():
        layer(y, y, y, causal=True, cache=full)
    assert str(error.value) == str(generic_error.value)
    for kept, old in zip(full, before, strict=True):
        torch.testing.assert_close(kept, old, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("rotary", ROUTE_ROTARY, ids=["plain", "rotary", "interleaved"])
def test_a_step_that_reads_a_non_finite_value_leaves_its_cache_as_it_found_it(rotary):
    """The host's step writes its rows before its finiteness read: a read that is not
    finite makes them zeros again, as a new cache holds them past its filled positions,
    and the cache's check holds for it still (the generic flow, which then runs the
    step, trusts it), so that the step's output and cache are the reference's."""
    options = {} if rotary is None else {"rotary": rotary}
    weights, layer = self_attention(HEADS, 41, **options)
    prompt = np.random.default_rng(41).standard_normal((3, 4, NUM_HIDDENS))
    _, caches = feed_back(layer, prompt, 2, 9)  # the prompt, two steps: the route's plan
    cache = caches[-1]
    before = [t.clone() for t in cache]
    x = torch.full((3, 1, NUM_HIDDENS), 0.5)
    x[2, 0, 5] = np.inf
    with torch.no_grad():
        declined = _facts.FACTS.plain_step(
            layer, x, cache, causal=True, dtype=torch.float32, options=layer.options
        )
    assert declined is None
    for kept, old in zip(cache, before, strict=True):
        torch.testing.assert_close(kept, old, rtol=0, atol=0)
    assert _cache.CacheCheck.of(cache) is not None
    expected, _, _ = spec.reference_cached_forward(
        weights,
        *(x.double().numpy(),) * 3,
        spec.KVCache(*(t.numpy() for t in before)),
        **HEADS,
        causal=True,
        **options,
    )
    with torch.no_grad():
        output, cache = layer(x, x, x, causal=True, cache=cache)
    np.testing.assert_array_equal(np.isnan(output.numpy()), np.isnan(expected))
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)
    assert not np.isfinite(expected[2]).any() and np.isfinite(expected[:2]).all()
    assert cache.lengths.tolist() == [7, 7, 7]


@pytest.mark.parametrize("scale", [1e17, 1e20])
@pytest.mark.parametrize("rotary", ROUTE_ROTARY, ids=["plain", "rotary", "interleaved"])
def test_a_step_of_finite_values_whose_squares_pass_float32_takes_the_generic_flow(rotary, scale):
    """The host's step reads its projections as their dot product with themselves: values
    near 1e20, finite but whose squares sum past float32's range, read as not finite, and
    the generic flow runs each step (its own read finds them finite and runs SDPA); near
    1e17 the route takes them. Either way, the generic flow's outputs and cache to the
    bit, and the reference's numbers."""
    options = {} if rotary is None else {"rotary": rotary}
    weights, layer = self_attention(HEADS, 43, **options)
    # Values near the scale (a step's 24 squares past float32's 3.4e38 at 1e20, within it
    # at 1e17), queries and keys as drawn: scores and outputs well within float32.
    weights = {k: v * scale if k in ("W_v", "b_v") else v for k, v in weights.items()}
    layer = set_weights(layer, {k: v.astype(np.float32) for k, v in weights.items()})
    weights = {k: v.astype(np.float32).astype(np.float64) for k, v in weights.items()}
    rng = np.random.default_rng(43)
    inputs = [rng.standard_normal((3, n, NUM_HIDDENS)).astype(np.float32) for n in (4, 1, 1, 1)]

    def decode(route):
        outputs, cache = [], layer.init_cache(3, 8)
        with contextlib.ExitStack() as stack:
            if not route:
                stack.enter_context(generic_only())
            answers = stack.enter_context(answered_calls())
            stack.enter_context(torch.no_grad())
            for x in map(torch.from_numpy, inputs):
                before = spec.KVCache(*(t.numpy().copy() for t in cache))
                output, cache = layer(x, x, x, causal=True, cache=cache)
                expected, _, _ = spec.reference_cached_forward(
                    weights, *(x.double().numpy(),) * 3, before, **HEADS, causal=True, **options
                )
                # (float32's rounding of values of this scale, cancellations among them)
                atol = FLOAT32_ATOL * np.abs(expected).max()
                np.testing.assert_allclose(output.double().numpy(), expected, rtol=0, atol=atol)
                outputs.append(output)
        return outputs, [cache], answers

    outputs, caches, answers = decode(route=True)
    # (The prompt's call, then each step: offered, and declined past float32's squares.)
    assert answers == [False] + [scale < 1e18] * 3
    assert np.abs(outputs[-1].numpy()).max() > scale / 10
    assert _cache.CacheCheck.of(caches[-1]) is not None
    generic_outputs, generic_caches, _ = decode(route=False)
    assert_same_decoding((outputs, caches), (generic_outputs, generic_caches))


@pytest.mark.parametrize("on_a_gpu", [False, True], ids=["host", "gpu"])
def test_a_step_on_a_cache_of_another_dtype_writes_nothing_and_raises_the_generic_error(on_a_gpu):
    """A float32 layer stepping on a float64 cache another layer wrote (and whose check
    it carries): the generic flow's ``TypeError`` naming the cache's array, and the cache
    as it was, whether the facts are told the tensors are on a GPU or not."""
    _, wide = self_attention(HEADS, seed=17, dtype=torch.float64)
    _, layer = self_attention(HEADS, seed=18)
    prompt = np.random.default_rng(17).standard_normal((3, 4, NUM_HIDDENS))
    told = backend.as_if_on_a_gpu() if on_a_gpu else contextlib.nullcontext()
    with told:
        outputs, caches = feed_back(wide, prompt, 2, 12)
        cache, y = caches[-1], outputs[-1].float()
        before = [t.clone() for t in cache]
        messages = []
        for route in (generic_only(), answered_calls()):
            refused = pytest.raises(TypeError, match="cache.keys dtype")
            with route, refused as error, torch.no_grad():
                layer(y, y, y, causal=True, cache=cache)
            messages.append(str(error.value))
    assert messages[0] == messages[1]
    for kept, old in zip(cache, before, strict=True):
        assert torch.equal(kept, old)


def test_the_plan_a_step_carries_serves_only_its_layer_weights_and_mode():
    """The plan a fast step leaves on the cache it wrote is the next step's only for the
    same layer, arguments and mode: another layer stepping the cache and weights changed
    in place give the reference's numbers of what they are, and a step under autocast
    the generic flow's error."""
    weights, layer = self_attention(HEADS, seed=15)
    other_weights, other = self_attention(HEADS, seed=16)
    prompt = np.random.default_rng(15).standard_normal((3, 4, NUM_HIDDENS))
    _, caches = feed_back(layer, prompt, 2, 12)
    cache, y = caches[-1], torch.full((3, 1, NUM_HIDDENS), 0.25)

    def step(of, named):
        nonlocal cache
        before = spec.KVCache(*(t.numpy().copy() for t in cache))
        output, cache = of(y, y, y, causal=True, cache=cache)
        expected, _, _ = spec.reference_cached_forward(
            named, *(y.double().numpy(),) * 3, before, **HEADS, causal=True
        )
        np.testing.assert_allclose(output.double().numpy(), expected, rtol=0, atol=FLOAT32_ATOL)

    with answered_calls() as answers, torch.no_grad():
        step(other, other_weights)
        step(layer, weights)
        layer.W_q.weight.mul_(0.5)
        step(layer, {**weights, "W_q": weights["W_q"] * 0.5})
        # Autocast projects bfloat16 keys, which a float32 cache does not hold: the
        # generic flow's error, nothing written, and the next step fast again.
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="cache"):
            step(layer, weights)
        step(layer, {**weights, "W_q": weights["W_q"] * 0.5})
    assert answers == [True, True, True, False, True]


def test_a_cache_made_outside_inference_mode_decodes_inside_it():
    """A step under ``torch.inference_mode()`` makes its cache's lengths ordinary tensors,
    whose versions carry its check forward: the fast route answers every step, in either
    mode, each with the reference's numbers."""
    weights, layer = self_attention(HEADS, seed=14)
    x = torch.from_numpy(np.random.default_rng(14).standard_normal((3, 4, NUM_HIDDENS)))
    x = x.float()
    with torch.no_grad():
        output, cache = layer(x, x, x, causal=True, cache=layer.init_cache(3, 9))
    y = output[:, -1:]
    modes = [torch.inference_mode, torch.inference_mode, torch.no_grad]
    with answered_calls() as answers:
        for mode in modes:
            before = spec.KVCache(*(t.numpy().copy() for t in cache))
            with mode():
                output, cache = layer(y, y, y, causal=True, cache=cache)
            expected, _, _ = spec.reference_cached_forward(
                weights, *(y.double().numpy(),) * 3, before, **HEADS, causal=True
            )
            np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)
            y = output
    assert answers == [True, True, True]
    assert not cache.lengths.is_inference()
    assert cache.lengths.tolist() == [7, 7, 7]


def _step_matches_the_reference(layer, weights, y, cache):
    """One step of ``y`` on ``cache``, checked against the reference of the cache as it is."""
    before = spec.KVCache(*(t.numpy().copy() for t in cache))
    with torch.no_grad():
        output, cache = layer(y, y, y, causal=True, cache=cache)
    expected, _, expected_lengths = spec.reference_cached_forward(
        weights, *(y.double().numpy(),) * 3, before, **HEADS, causal=True
    )
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)
    np.testing.assert_array_equal(cache.lengths.numpy(), expected_lengths.lengths)
    return output, cache


def test_a_saved_cache_loads_and_decodes_on():
    """A cache pickles as its tensors (``torch.save``, loaded with ``weights_only``): what
    a call knew of it stays with the tensors it was made for, and the loaded one
    decodes on with the reference's numbers."""
    weights, layer = self_attention(HEADS, seed=15)
    x = torch.from_numpy(np.random.default_rng(15).standard_normal((3, 4, NUM_HIDDENS))).float()
    with torch.no_grad():
        output, cache = layer(x, x, x, causal=True, cache=layer.init_cache(3, 9))
    output, cache = _step_matches_the_reference(layer, weights, output[:, -1:], cache)
    buffer = io.BytesIO()
    torch.save(tuple(cache), buffer)
    buffer.seek(0)
    loaded = spec.KVCache(*torch.load(buffer))
    assert copy.deepcopy(cache).lengths.tolist() == [5, 5, 5]
    for _ in range(2):
        output, loaded = _step_matches_the_reference(layer, weights, output, loaded)
    assert loaded.lengths.tolist() == [7, 7, 7]


@pytest.mark.parametrize("swapped", ["lengths", "values"])
@pytest.mark.parametrize("on_a_gpu", [False, True], ids=["host", "gpu"])
def test_storage_swapped_in_through_data_is_read_anew(swapped, on_a_gpu):
    """``.data =`` gives a tensor other storage but keeps its version counter: a check made
    for the old storage (the lengths on the host, the views a step attends over) no
    longer holds, and the step has the reference's numbers for the new."""
    weights, layer = self_attention(HEADS, seed=16, sinks=False)
    x = torch.from_numpy(np.random.default_rng(16).standard_normal((3, 4, NUM_HIDDENS))).float()
    context = backend.as_if_on_a_gpu() if on_a_gpu else contextlib.nullcontext()
    with context:
        with torch.no_grad():
            output, cache = layer(x, x, x, causal=True, cache=layer.init_cache(3, 9))
        for _ in range(2):
            output, cache = _step_matches_the_reference(layer, weights, output[:, -1:], cache)
            output = output[:, -1:]
        tensor = getattr(cache, swapped)
        tensor.data = tensor.data - 2 if swapped == "lengths" else tensor.data * 2
        for _ in range(2):
            output, cache = _step_matches_the_reference(layer, weights, output, cache)
    assert cache.lengths.tolist() == ([6, 6, 6] if swapped == "lengths" else [8, 8, 8])


def test_a_fast_step_raises_the_generic_flows_errors():
    """Queries that do not fit the layer or the cache are refused as the generic flow
    refuses them, whether or not an earlier step of the same cache took the fast route."""
    _, layer = self_attention(HEADS, seed=13)
    prompt = np.random.default_rng(13).standard_normal((3, 4, NUM_HIDDENS))
    _, caches = feed_back(layer, prompt, 2, 9)
    wrong = [
        (TypeError, torch.zeros(3, 1, NUM_HIDDENS, dtype=torch.float64)),
        (ValueError, torch.zeros(3, 1, NUM_HIDDENS + 1)),
        (ValueError, torch.zeros(2, 1, NUM_HIDDENS)),
    ]
    for kind, x in wrong:
        messages = []
        for route in (generic_only(), answered_calls()):
            with route, pytest.raises(kind) as error, torch.no_grad():
                layer(x, x, x, causal=True, cache=caches[-1])
            messages.append(str(error.value))
        assert messages[0] == messages[1]
        assert torch.equal(caches[-1].lengths, torch.tensor([6, 6, 6], dtype=torch.int32))


@pytest.mark.parametrize("new_lens", [None, np.array([2, 1, 2])], ids=["uniform", "ragged"])
def test_a_long_generation_takes_the_route_with_each_steps_own_lengths(new_lens):
    """Past the lengths the steps make at once (64 steps' each time, three banks of
    them): every step takes the route to the generic flow's outputs and cache to the
    bit, and each step's lengths hold its own values after the steps that follow."""
    _, layer = self_attention(HEADS, 47)
    prompt = np.random.default_rng(47).standard_normal((3, 2, NUM_HIDDENS))
    steps = 3 * 64 + 8
    with answered_calls() as answers:
        ours = feed_back(layer, prompt, steps, steps + 2, new_lens)
    # (The prompt's call is offered where it has no lengths, and declined.)
    assert answers == [False] * (new_lens is None) + [True] * steps
    with generic_only():
        theirs = feed_back(layer, prompt, steps, steps + 2, new_lens)
    assert_same_decoding(ours, theirs)
    first = np.array([2, 2, 2]) if new_lens is None else new_lens
    for step, cache in enumerate(ours[1]):
        assert cache.lengths.tolist() == (first + step).tolist()


@pytest.mark.parametrize("new_lens", [None, np.array([2, 1, 2])], ids=["uniform", "ragged"])
def test_a_long_generation_leaves_the_collector_no_objects(new_lens):
    """No step of a loop that keeps only the last cache makes objects for the garbage
    collector by the hundred, past three banks of lengths (64 steps' each): a bank's
    rows are objects made at once, alive for as many steps, which by the hundred
    set off the collector's passes (a full one walks every object of the process)
    within a decoding loop; and the loop leaves as many as it found."""
    _, layer = self_attention(HEADS, 48)
    prompt = torch.from_numpy(np.random.default_rng(48).standard_normal((3, 2, NUM_HIDDENS)))
    lens = None if new_lens is None else torch.from_numpy(new_lens)
    counts = []
    collecting = gc.isenabled()
    gc.disable()  # (the count is then the tracked objects made less those gone)
    try:
        with torch.no_grad(), answered_calls() as answers:
            x = prompt.float()
            y, cache = layer(x, x, x, lens, causal=True, cache=layer.init_cache(3, 220))
            y = y[:, -1:]
            for _ in range(200):
                y, cache = layer(y, y, y, causal=True, cache=cache)
                counts.append(gc.get_count()[0])
    finally:
        if collecting:
            gc.enable()
    assert answers[-200:] == [True] * 200
    made = [after - before for before, after in itertools.pairwise(counts)]
    assert max(made) <= 64, made
    if new_lens is None:  # (a ragged step adds one to the count, not to the objects tracked)
        assert counts[-1] - counts[0] <= 8, (counts[0], counts[-1])


@pytest.mark.parametrize("new_lens", [None, np.array([5, 3, 4])], ids=["uniform", "ragged"])
@pytest.mark.parametrize("route", ["host", "gpu", "generic"])
def test_a_cache_its_caller_drops_goes_at_once(route, new_lens):
    """What a call knows of the cache it wrote (its check, the views a step attends over,
    what the write told the plan) keeps none of the cache's tensors alive: dropped after
    steps on the host's route, a GPU's or the generic flow, they go at once, with no
    cycle left for the garbage collector (on a GPU, memory a caller frees to make the
    next cache)."""
    _, layer = self_attention(HEADS, seed=22, rotary=ROUTE_ROTARY[1])
    prompt = np.random.default_rng(22).standard_normal((3, 5, NUM_HIDDENS))
    context = {
        "host": contextlib.nullcontext(),
        "gpu": backend.as_if_on_a_gpu(),
        "generic": generic_only(),
    }[route]
    collecting = gc.isenabled()
    gc.disable()
    try:
        with context, answered_calls() as answers:
            outputs, caches = feed_back(layer, prompt, 70, 80, new_lens)
        held = [weakref.ref(t) for cache in caches for t in cache]
        del outputs, caches
        assert [ref() for ref in held] == [None] * len(held)
    finally:
        if collecting:
            gc.enable()
    assert (True in answers) == (route != "generic")  # (the route took steps)
