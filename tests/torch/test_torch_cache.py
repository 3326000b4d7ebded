"""What only the PyTorch backend's key/value cache has: torch.compile, SDPA, autograd.

The generic cache tests (every dtype, random schedules, the per-query loop,
errors) are ``tests/backends/test_cache.py``'s; here every result is checked
against the float64 reference as well.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from route_support import answered_calls, generic_only
from torch._dynamo.testing import CompileCounterWithBackend

from conftest import recording_host_moves
from mha_multi import spec
from mha_multi.parity.decode import INPUT_NAMES, chunk_rows, decode, full_reference
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import KVCache, MultiHeadAttention, _cache, _reads, set_weights
from mha_multi.weights import init_weights
from tests.backends import test_edges as edges

#: Grouped heads and biases: two query heads read each key/value head.
HEADS = {"num_heads": 4, "num_kv_heads": 2}
NUM_HIDDENS, QUERY_SIZE, HEAD_DIM = 16, 5, 4
#: A ragged prefill, steps of 1 (with idle examples) and a chunk of 3.
CHUNKS = [(4, [4, 2, 0]), (1, [1, 1, 1]), (1, [1, 0, 1]), (3, [2, 3, 3]), (1, [1, 1, 0])]
LENGTHS = np.array([9, 7, 5])
FLOAT32_ATOL = 5e-6


@pytest.fixture
def compiler():
    """``torch.compile`` with dynamo's caches emptied (``forward``'s compilations are limited)."""
    torch._dynamo.reset()
    yield torch.compile
    torch._dynamo.reset()


def make(seed: int, dtype: torch.dtype = torch.float32, length: int = 9):
    weights = init_weights(NUM_HIDDENS, bias=True, seed=seed, query_size=QUERY_SIZE, **HEADS)
    layer = MultiHeadAttention(NUM_HIDDENS, bias=True, dtype=dtype, **HEADS)
    layer = set_weights(layer, {k: v.astype(np.float32) for k, v in weights.items()}).eval()
    weights = {k: v.astype(np.float32).astype(np.float64) for k, v in weights.items()}
    rng = np.random.default_rng(seed)
    sizes = {"queries": QUERY_SIZE, "keys": NUM_HIDDENS, "values": NUM_HIDDENS}
    inputs = {
        name: rng.standard_normal((3, length, size)).astype(np.float32)
        for name, size in sizes.items()
    }
    return weights, layer, inputs


def tensors(*arrays, dtype=torch.float32):
    """Numpy arrays as tensors: floating ones of ``dtype``, integer lengths as they are."""
    converted = []
    for x in arrays:
        x = None if x is None else torch.from_numpy(np.array(x, copy=True))
        converted.append(x.to(dtype) if x is not None and x.is_floating_point() else x)
    return converted


def stepper(layer, cache):
    """A :data:`mha_multi.parity.decode.Step` through ``layer``; ``caches`` collects each cache."""
    caches = [cache]

    def step(queries, keys, values, new_lens):
        with torch.no_grad():
            output, cache = layer(
                *tensors(queries, keys, values, new_lens), causal=True, cache=caches[-1]
            )
        caches.append(cache)
        return output.numpy()

    return step, caches


def projected_heads(weights, x, name):
    """Float64 ``x @ W + b`` split into heads, ``(B, H_kv, T, dh)``: what a cache holds."""
    y = x.astype(np.float64) @ weights[f"W_{name}"] + weights[f"b_{name}"]
    return y.reshape(*y.shape[:2], -1, HEAD_DIM).transpose(0, 2, 1, 3)


def held(cache, name):
    """The cache's ``keys`` or ``values`` with the free positions zeroed, as numpy."""
    x = getattr(cache, name).detach().numpy()
    positions = np.arange(x.shape[2]) < cache.lengths.numpy()[:, None]
    return np.where(positions[:, None, :, None], x, 0.0)


# -- torch.compile ---------------------------------------------------------------


def test_compiled_decoding_equals_eager_and_the_reference(compiler):
    """One graph per chunk length, however many steps; the numbers of the float64 spec."""
    weights, layer, inputs = make(0)
    counter = CompileCounterWithBackend("inductor")
    compiled = compiler(layer, fullgraph=True, dynamic=False, backend=counter)
    compiled_step, compiled_caches = stepper(compiled, layer.init_cache(3, 10))
    eager_step, eager_caches = stepper(layer, layer.init_cache(3, 10))

    compiled_output = decode(compiled_step, inputs, LENGTHS, CHUNKS)
    eager_output = decode(eager_step, inputs, LENGTHS, CHUNKS)

    assert counter.frame_count == len({size for size, _ in CHUNKS})  # T = 4, 1, 3
    expected = full_reference(weights, inputs, LENGTHS, **HEADS)
    for output in (compiled_output, eager_output):
        np.testing.assert_allclose(output, expected, rtol=0, atol=FLOAT32_ATOL)
    for compiled_cache, eager_cache in zip(compiled_caches, eager_caches, strict=True):
        assert torch.equal(compiled_cache.lengths, eager_cache.lengths)
        assert compiled_cache.lengths.dtype == torch.int32
        for name in ("keys", "values"):
            np.testing.assert_allclose(
                held(compiled_cache, name), held(eager_cache, name), rtol=0, atol=FLOAT32_ATOL
            )
    assert compiled_caches[-1].lengths.tolist() == LENGTHS.tolist()
    for name, projection in (("keys", "k"), ("values", "v")):
        expected_cache = projected_heads(weights, inputs[name], projection)
        expected_cache = np.where(  # positions past the lengths are free
            (np.arange(9) < LENGTHS[:, None])[:, None, :, None], expected_cache, 0.0
        )
        np.testing.assert_allclose(
            held(compiled_caches[-1], name)[:, :, :9], expected_cache, rtol=0, atol=FLOAT32_ATOL
        )


@pytest.mark.parametrize("rotary", [None, {"theta": 100.0}], ids=["plain", "rotary"])
def test_compiled_self_attention_steps_are_one_graph_of_the_eager_numbers(rotary):
    """A decoding step of self-attention, plain and Llama-shaped (rotary, grouped heads),
    traces to one graph without a break (``torch._dynamo.explain``), static shapes; the
    compiled prefill and steps give the eager numbers."""
    _, layer = self_attention(HEADS, seed=15, rotary=rotary)
    x = torch.from_numpy(np.random.default_rng(15).standard_normal((3, 4, NUM_HIDDENS)))
    x = x.float()
    with torch.no_grad():
        _, cache = layer(x, x, x, causal=True, cache=layer.init_cache(3, 8))
        y = x[:, -1:].contiguous()
        explained = torch._dynamo.explain(layer)(y, y, y, causal=True, cache=cache)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="eager")
    caches = {"eager": layer.init_cache(3, 8), "compiled": layer.init_cache(3, 8)}
    outputs = {}
    for name, run in (("eager", layer), ("compiled", compiled)):
        token, cache = x, caches[name]
        with torch.no_grad():
            for _ in range(3):
                token, cache = run(token, token, token, causal=True, cache=cache)
                token = token[:, -1:].contiguous()
        outputs[name], caches[name] = token, cache
    torch.testing.assert_close(outputs["compiled"], outputs["eager"], rtol=0, atol=FLOAT32_ATOL)
    assert caches["compiled"].lengths.tolist() == caches["eager"].lengths.tolist() == [6] * 3


def test_compiled_overflow_drops_positions_and_keeps_counting(compiler):
    """Eager raises; compiled code writes what fits, overwrites nothing held, counts on."""
    weights, layer, inputs = make(1, length=7)
    cache = layer.init_cache(3, 4)
    rows = [x[:, :3] for x in inputs.values()]
    with torch.no_grad():
        _, cache = layer(*tensors(*rows, np.array([3, 1, 0])), causal=True, cache=cache)
    before = {name: getattr(cache, name).clone() for name in ("keys", "values")}
    new_rows = [x[:, 3:6] for x in inputs.values()]
    new = {"keys": projected_heads(weights, new_rows[1], "k")}
    new["values"] = projected_heads(weights, new_rows[2], "v")
    with pytest.raises(ValueError, match="overflows: example 0 would hold 6"):
        layer(*tensors(*new_rows), causal=True, cache=cache)

    counter = CompileCounterWithBackend("inductor")
    compiled = compiler(layer, fullgraph=True, dynamic=False, backend=counter)
    with torch.no_grad():
        _, overflowed = compiled(*tensors(*new_rows), causal=True, cache=cache)
    assert overflowed.lengths.tolist() == [6, 4, 3]  # lengths > max_length tell it happened
    for name in ("keys", "values"):
        kept, old, written = getattr(overflowed, name).numpy(), before[name].numpy(), new[name]
        # Example 0 held 3 and fits 1 more; example 1 held 1 and fits 3; example 2 appends 3.
        np.testing.assert_array_equal(kept[0, :, :3], old[0, :, :3])
        np.testing.assert_allclose(kept[0, :, 3], written[0, :, 0], rtol=0, atol=FLOAT32_ATOL)
        np.testing.assert_array_equal(kept[1, :, :1], old[1, :, :1])
        np.testing.assert_allclose(kept[1, :, 1:], written[1], rtol=0, atol=FLOAT32_ATOL)
        np.testing.assert_allclose(kept[2, :, :3], written[2], rtol=0, atol=FLOAT32_ATOL)
        np.testing.assert_array_equal(kept[2, :, 3], old[2, :, 3])

    # A full cache takes nothing more and overwrites nothing; the same graph serves.
    # (It writes into the given cache's tensors: what they held is copied first.)
    full = {name: getattr(overflowed, name).clone() for name in ("keys", "values")}
    with torch.no_grad():
        _, after = compiled(*tensors(*new_rows, np.array([1, 1, 1])), causal=True, cache=overflowed)
    assert after.lengths.tolist() == [7, 5, 4]
    assert counter.frame_count == 2  # valid_lens None, then given: two signatures
    for name in ("keys", "values"):
        kept, old = getattr(after, name), full[name]
        assert torch.equal(kept[:2], old[:2])
        assert torch.equal(kept[2, :, :3], old[2, :, :3])
        assert not torch.equal(kept[2, :, 3], old[2, :, 3])


# -- eager writes in place ---------------------------------------------------------


def test_eager_calls_without_gradients_write_the_cache_in_place():
    """A ragged schedule whose examples sit at different positions, filling the cache
    exactly: every step writes into the same tensors, with the spec's numbers; an
    overflow is refused with nothing written."""
    weights, layer, inputs = make(3)
    step, caches = stepper(layer, layer.init_cache(3, int(LENGTHS.max())))
    output = decode(step, inputs, LENGTHS, CHUNKS)

    np.testing.assert_allclose(
        output, full_reference(weights, inputs, LENGTHS, **HEADS), rtol=0, atol=FLOAT32_ATOL
    )
    for cache in caches[1:]:
        assert cache.keys is caches[0].keys and cache.values is caches[0].values
    assert caches[-1].lengths.tolist() == LENGTHS.tolist()  # example 0 holds max_length
    for name, projection in (("keys", "k"), ("values", "v")):
        expected = projected_heads(weights, inputs[name], projection)
        expected = np.where((np.arange(9) < LENGTHS[:, None])[:, None, :, None], expected, 0.0)
        np.testing.assert_allclose(held(caches[-1], name), expected, rtol=0, atol=FLOAT32_ATOL)

    before = [x.clone() for x in caches[-1]]
    rows = tensors(*(x[:, :1] for x in inputs.values()), np.array([1, 0, 0]))
    with pytest.raises(ValueError, match="overflows: example 0 would hold 10"), torch.no_grad():
        layer(*rows, causal=True, cache=caches[-1])
    for kept, old in zip(caches[-1], before, strict=True):
        assert torch.equal(kept, old)


def test_calls_recording_gradients_leave_the_given_cache_as_it_was():
    _, layer, inputs = make(4)
    cache = layer.init_cache(3, 5)
    rows = tensors(*(x[:, :2] for x in inputs.values()))
    output, updated = layer(*rows, causal=True, cache=cache)
    assert output.requires_grad and updated.keys is not cache.keys
    assert not cache.keys.any() and not cache.values.any()
    assert cache.lengths.tolist() == [0, 0, 0] and updated.lengths.tolist() == [2, 2, 2]


# -- SDPA for eager cached calls ---------------------------------------------------


def sdpa_spy():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", wraps=sdpa)


def prefilled(layer, inputs, new_lens, max_length=7):
    """A cache after one call of ``inputs``' first 3 positions, ``new_lens`` of them kept."""
    cache = layer.init_cache(3, max_length)
    rows = tensors(*(x[:, :3] for x in inputs.values()), new_lens, dtype=layer.W_o.weight.dtype)
    with torch.no_grad():
        _, cache = layer(*rows, causal=True, cache=cache)
    return cache


def numpy_cache(cache):
    return spec.KVCache(*(x.detach().numpy() for x in cache))


@pytest.mark.parametrize("causal", [True, False])
def test_eager_cached_calls_run_sdpa_with_the_plans_mask(causal):
    """Grouped key/value heads go to SDPA unrepeated, in the cache's own layout.

    Example 2 holds nothing and appends nothing: its fully hidden rows get the
    spec's uniform weights over the whole cache, free positions included.
    """
    weights, layer, inputs = make(2)
    cache = prefilled(layer, inputs, np.array([3, 1, 0]))
    rows = [chunk_rows(x, np.array([3, 1, 0]), 3) for x in inputs.values()]
    new_lens = np.array([2, 3, 0])
    expected, _, expected_cache = spec.reference_cached_forward(
        weights, *rows, numpy_cache(cache), new_lens, **HEADS, causal=causal
    )
    with backend.kernel_spy() as calls, sdpa_spy() as spy, torch.no_grad():
        output, after = layer(*tensors(*rows, new_lens), causal=causal, cache=cache)
    assert len(calls) == 1 and calls[0].mask and not calls[0].is_causal
    query, key, value = spy.call_args.args[:3]
    assert query.shape == (3, 4, 3, HEAD_DIM)
    assert key.shape == value.shape == (3, 2, 7, HEAD_DIM)
    assert spy.call_args.kwargs["enable_gqa"] is True
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)
    assert after.lengths.tolist() == expected_cache.lengths.tolist()

    with backend.kernel_spy() as calls, torch.no_grad():
        output, attention_weights, _ = layer(
            *tensors(*rows, new_lens), causal=causal, cache=cache, return_attention_weights=True
        )
    assert calls == []  # the weights come from the generic path
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)
    np.testing.assert_allclose(attention_weights[2].numpy(), 1 / 7, rtol=0, atol=1e-7)


def test_a_full_cache_needs_no_mask():
    """Lengths that hide nothing (every example holds max_length) give SDPA no mask."""
    weights, layer, inputs = make(3)
    cache = prefilled(layer, inputs, None, max_length=3)
    queries = inputs["queries"][:, 3:5]
    expected, _, _ = spec.reference_cached_forward(
        weights, queries, None, None, numpy_cache(cache), **HEADS, causal=True
    )
    with backend.kernel_spy() as calls, torch.no_grad():
        output, _ = layer(*tensors(queries), None, None, causal=True, cache=cache)
    assert len(calls) == 1 and not calls[0].mask and not calls[0].is_causal
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)


@pytest.mark.parametrize(
    ("position", "fused"),
    [
        # Example 2 holds 1 position and appends 1: position 3 is free, inside
        # the 4 filled positions the batch attends over (example 0: 3 + 1).
        ((2, 1, 3, 0), False),
        # Past every example's filled positions: not attended over at all.
        ((0, 1, 6, 0), True),
    ],
)
def test_a_non_finite_entry_at_a_free_position_keeps_the_spec_numbers(position, fused):
    """SDPA adds -inf to a hidden key's score, and NaN + -inf is NaN; the spec replaces it."""
    weights, layer, inputs = make(4)
    cache = prefilled(layer, inputs, np.array([3, 2, 1]))
    keys = cache.keys.clone()
    keys[position] = np.nan
    cache = KVCache(keys, cache.values, cache.lengths)
    rows = [chunk_rows(x, np.array([3, 2, 1]), 1) for x in inputs.values()]
    expected, _, _ = spec.reference_cached_forward(
        weights, *rows, numpy_cache(cache), **HEADS, causal=True
    )
    assert np.isfinite(expected).all()
    with backend.kernel_spy() as calls, torch.no_grad():
        output, _ = layer(*tensors(*rows), causal=True, cache=cache)
    assert bool(calls) == fused
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)


def test_a_cache_edited_in_place_is_read_again():
    """A decoding step trusts what its own writes found finite only while nobody else wrote.

    The NaN goes into a free position of example 2 that the prefill already
    attended over (example 0 filled 3), which SDPA's added -inf would turn
    into a NaN row and the spec hides: the edit (a new version of the same
    tensor) must send the call back to reading the cache.
    """
    weights, layer, inputs = make(4)
    cache = prefilled(layer, inputs, np.array([3, 2, 1]))
    rows = [chunk_rows(x, np.array([3, 2, 1]), 1) for x in inputs.values()]
    with torch.no_grad():
        cache.keys[2, 1, 2, 0] = np.nan  # in place: the same tensors, the same lengths
    expected, _, _ = spec.reference_cached_forward(
        weights, *rows, numpy_cache(cache), **HEADS, causal=True
    )
    assert np.isfinite(expected).all()
    with backend.kernel_spy() as calls, torch.no_grad():
        output, _ = layer(*tensors(*rows), causal=True, cache=cache)
    assert calls == []
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)


def test_lengths_edited_in_place_are_read_again():
    """A step knows the lengths its previous step wrote without reading them back,
    only while the lengths tensor is unchanged: an edit (one example rewound by
    a position, another set to the cache's end) is read, checked and used."""
    weights, layer, inputs = make(6)
    cache = prefilled(layer, inputs, np.array([3, 2, 1]))
    rows = [chunk_rows(x, np.array([3, 2, 1]), 1) for x in inputs.values()]
    with torch.no_grad():
        cache.lengths[1] -= 1
    expected, _, _ = spec.reference_cached_forward(
        weights, *rows, numpy_cache(cache), **HEADS, causal=True
    )
    with torch.no_grad():
        output, after = layer(*tensors(*rows), causal=True, cache=cache)
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=FLOAT32_ATOL)
    assert after.lengths.tolist() == [4, 2, 2]
    with torch.no_grad():
        after.lengths[2] = 7
    with pytest.raises(ValueError, match="overflows: example 2 would hold 8"), torch.no_grad():
        layer(*tensors(*rows), causal=True, cache=after)


@pytest.mark.parametrize(
    ("inference", "made_by"),
    [(False, "init_cache"), (True, "init_cache"), (True, "user")],
    ids=["no_grad", "inference_mode", "inference tensors"],
)
def test_decoding_steps_read_only_their_new_rows(inference, made_by):
    """Under ``no_grad`` or ``inference_mode`` a step's finiteness comes from the rows
    it writes and the previous step's flag (``init_cache`` makes ordinary tensors, with
    versions, in either mode); a cache of inference tensors keeps no versions, so each
    step reads the attended cache positions again."""
    weights, layer, inputs = make(5)
    mode = torch.inference_mode if inference else torch.no_grad
    with mode():
        if made_by == "init_cache":
            cache = layer.init_cache(3, 9)
            assert not any(x.is_inference() for x in cache)
        else:
            shape = layer.init_cache(3, 9).keys.shape
            cache = KVCache(
                torch.zeros(shape), torch.zeros(shape), torch.zeros(3, dtype=torch.int32)
            )
        rows = tensors(*(x[:, :4] for x in inputs.values()))
        _, cache = layer(*rows, causal=True, cache=cache)
        token = tensors(*(x[:, 4:5] for x in inputs.values()))
        with (
            mock.patch.object(_reads, "covering", wraps=_reads.covering) as covering,
            mock.patch.object(_cache, "poison_of", wraps=_cache.poison_of) as poison,
        ):
            output, cache = layer(*token, causal=True, cache=cache)
    # What the step summed: (B, T, features) projections, or (B, H_kv, K, dh) cache positions.
    summed = [x.dim() for spy in (covering, poison) for c in spy.call_args_list for x in c.args]
    assert (4 in summed) == (made_by == "user")
    expected = full_reference(weights, inputs, np.array([5, 5, 5]), **HEADS)
    # The reference's last position is the step's.
    np.testing.assert_allclose(output.numpy()[:, 0], expected[:, 4], rtol=0, atol=FLOAT32_ATOL)


# -- a plain decoding step's fast route -------------------------------------------------


def self_attention(heads, seed, dtype=torch.float32, **options):
    """A self-attention layer (every input of ``NUM_HIDDENS``) and its float64 weights."""
    weights = init_weights(NUM_HIDDENS, bias=True, seed=seed, **heads)
    layer = MultiHeadAttention(NUM_HIDDENS, bias=True, dtype=dtype, **heads, **options)
    layer = set_weights(layer, {k: v.astype(np.float32) for k, v in weights.items()}).eval()
    return {k: v.astype(np.float32).astype(np.float64) for k, v in weights.items()}, layer


def feed_back(layer, prompt, steps, max_length, new_lens=None, *, check=None):
    """Decodes ``steps`` tokens, each step's input the last output; returns outputs and caches.

    ``check(step_input, cache_before, output)`` is called at every step,
    with the cache before the step as numpy (the step writes in place).
    """
    dtype = layer.W_o.weight.dtype
    with torch.no_grad():
        x = torch.from_numpy(prompt).to(dtype)
        lens = None if new_lens is None else torch.from_numpy(new_lens)
        output, cache = layer(x, x, x, lens, causal=True, cache=layer.init_cache(3, max_length))
        outputs, caches = [output], [cache]
        y = output[:, -1:]
        for _ in range(steps):
            before = spec.KVCache(*(t.numpy().copy() for t in cache))
            y, cache = layer(y, y, y, causal=True, cache=cache)
            if check is not None:
                check(outputs[-1][:, -1:], before, y)
            outputs.append(y)
            caches.append(cache)
    return outputs, caches


@pytest.mark.parametrize("finite_from", [None, 3, 9])
@pytest.mark.parametrize("key_upto", [0, 2, 9])
@pytest.mark.parametrize("pending", [False, True])
def test_a_steps_check_is_the_one_attach_and_written_past_make(finite_from, key_upto, pending):
    """``CacheCheck.stepped``, a plain step's shortcut, leaves the check that attaching
    a new one and carrying over what the prior knew (``written_past``) leave, field by
    field: what the next step and every later call trust."""
    keys, values = torch.zeros(2, 1, 9, 4), torch.zeros(2, 1, 9, 4)
    prior = _cache.CacheCheck.attach(
        spec.KVCache(keys, values, torch.full((2,), 4)), None, 4, np.full(2, 4), pending=None
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

    slow = _cache.CacheCheck.attach(
        updated(), kept["poison"], 5, prior.lengths, pending=kept["pending"], added=1
    )
    slow.step, slow._uniform = "this plan", 5
    slow.written_past(prior, 4, 5)
    fast = prior.stepped(updated(), 5, "this plan", **kept)
    # (The arrays, poison and pending rows are the same objects in both: compared by identity.)
    fields = {name: value for name, value in vars(slow).items() if name not in ("keys", "values")}
    assert {name: value for name, value in vars(fast).items() if name in fields} == fields
    assert vars(fast).keys() == vars(slow).keys()
    assert fast.keys() is keys and fast.values() is values
    assert fast.lengths.tolist() == [5, 5] and fast.uniform == 5


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


#: Rotary embeddings a decoding route takes: none, half-split, interleaved pairs of a part.
ROUTE_ROTARY = [None, {"theta": 100.0}, {"theta": 50.0, "fraction": 0.5, "interleaved": True}]


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


def test_steps_the_fast_route_declines_take_the_generic_flow():
    """Ragged lengths, a NaN in a step's input and grouped heads all give the reference's
    numbers, NaN rows where it has them; a full cache refuses the next step with the
    generic flow's error and nothing written."""
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
    assert answers == [False] * 3  # the examples hold 4, 2 and 3 positions
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


@pytest.mark.parametrize(
    "heads, prompt_length, max_length, rotary",
    [
        ({"num_heads": 4}, 61, 80, None),
        (HEADS, 61, 80, None),
        (HEADS, 300, 400, None),
        (HEADS, 61, 80, ROUTE_ROTARY[1]),
    ],
    ids=["mha", "gqa", "after a prefill that reads", "gqa-rotary"],
)
def test_plain_steps_on_a_gpu_run_the_generic_path_and_read_nothing(
    heads, prompt_length, max_length, rotary, monkeypatch
):
    """On a GPU a step's finiteness read would wait for the device: the route runs the
    generic path's attention over the filled positions rounded up to the span bucket
    (64, then the whole cache of 80), reading nothing and making no tensor of host data;
    the generic flow's outputs and cache to the bit, and the reference's numbers. A
    prefill of 300 positions reads (its 300 queries see a span of 320, and the scores
    in all that a call recording no gradient reads from are set to its own): its check
    stands for 20 positions more than are filled, and the steps take the route too. A
    rotary layer's steps too."""
    span = spec.rounded_span(prompt_length, max_length, spec.SPAN_BUCKET)
    prefill_scores = 3 * heads["num_heads"] * prompt_length * span
    monkeypatch.setattr("mha_multi.spec.plan.DEVICE_READ_TOTAL_SCORES", prefill_scores)
    weights, layer = self_attention(heads, seed=13, rotary=rotary)
    prompt = np.random.default_rng(13).standard_normal((3, prompt_length, NUM_HIDDENS))

    def against_reference(x, before, output):
        expected, _, _ = spec.reference_cached_forward(
            weights, *(x.double().numpy(),) * 3, before, **heads, causal=True, rotary=rotary
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


# -- autograd through the cache --------------------------------------------------------


def test_gradients_through_the_cache_are_the_full_forwards():
    """Decoding with autograd differentiates like one full causal forward.

    Earlier calls' keys and values reach later outputs through the cache, so
    every input and weight gradient is that of the full forward; padding rows
    (other positions' data) get none.
    """
    weights, layer, inputs = make(5, dtype=torch.float64)
    layer.zero_grad(set_to_none=True)
    full = {
        name: torch.from_numpy(x.astype(np.float64)).requires_grad_() for name, x in inputs.items()
    }
    rng = np.random.default_rng(5)
    real = np.arange(9) < LENGTHS[:, None]
    output_gradient = np.where(real[..., None], rng.standard_normal((3, 9, NUM_HIDDENS)), 0.0)
    gradient = torch.from_numpy(output_gradient)
    cache = layer.init_cache(3, 10)
    consumed = np.zeros(3, np.int64)
    loss = 0.0
    for num_new, new_lens in CHUNKS:
        index = torch.from_numpy((consumed[:, None] + np.arange(num_new)) % 9)[..., None]
        rows = [torch.take_along_dim(full[name], index, dim=1) for name in INPUT_NAMES]
        output, cache = layer(*rows, torch.tensor(new_lens), causal=True, cache=cache)
        for b, n in enumerate(new_lens):
            loss = loss + (output[b, :n] * gradient[b, consumed[b] : consumed[b] + n]).sum()
        consumed += new_lens
    loss.backward()

    expected = spec.reference_gradients(
        weights,
        *inputs.values(),
        LENGTHS,
        **HEADS,
        causal=True,
        output_gradient=output_gradient,
    )
    for name in INPUT_NAMES:
        np.testing.assert_allclose(full[name].grad.numpy(), expected[name], rtol=0, atol=1e-10)
        assert not full[name].grad.numpy()[~real].any()
    for name in ("W_q", "W_k", "W_v", "W_o"):
        linear = getattr(layer, name)
        np.testing.assert_allclose(linear.weight.grad.T.numpy(), expected[name], atol=1e-10)
        np.testing.assert_allclose(linear.bias.grad.numpy(), expected[f"b_{name[-1]}"], atol=1e-10)


def test_the_returned_cache_is_differentiable_in_the_new_keys():
    """``d sum(cache.keys * g) / d keys`` is ``g`` at the written positions, through ``W_k``."""
    weights, layer, inputs = make(6, dtype=torch.float64)
    cache = prefilled(layer, inputs, np.array([3, 1, 0]))
    queries, keys, values = tensors(*(x[:, 3:5] for x in inputs.values()), dtype=torch.float64)
    keys.requires_grad_()
    _, after = layer(queries, keys, values, torch.tensor([2, 1, 0]), cache=cache)
    g = np.random.default_rng(6).standard_normal(after.keys.shape)
    (after.keys * torch.from_numpy(g)).sum().backward()
    expected = np.zeros(keys.shape)
    for b, (start, n) in enumerate([(3, 2), (1, 1), (0, 0)]):
        written = g[b, :, start : start + n].transpose(1, 0, 2).reshape(n, 2 * HEAD_DIM)
        expected[b, :n] = written @ weights["W_k"].T
    np.testing.assert_allclose(keys.grad.numpy(), expected, rtol=0, atol=1e-12)


# -- the cache's own arguments -----------------------------------------------------------


def test_init_cache_takes_a_floating_dtype():
    _, layer, _ = make(7)
    cache = layer.init_cache(2, 5, dtype=torch.bfloat16)
    assert cache.keys.dtype == cache.values.dtype == torch.bfloat16
    assert cache.lengths.dtype == torch.int32
    assert layer.double().init_cache(1, 2).keys.dtype == torch.float64
    for dtype in (torch.int64, "float32"):
        with pytest.raises(TypeError, match="floating-point torch.dtype"):
            layer.init_cache(2, 5, dtype=dtype)


def test_a_cache_that_is_not_the_layers_is_a_clear_error():
    _, layer, inputs = make(8)
    rows = tensors(*(x[:, :2] for x in inputs.values()))
    cache = layer.init_cache(3, 4)
    with pytest.raises(TypeError, match="cache.keys dtype torch.float64 differs"):
        layer(*rows, cache=KVCache(cache.keys.double(), cache.values, cache.lengths))
    with pytest.raises(TypeError, match="cache.values dtype torch.float64 differs"):
        layer(rows[0], None, None, cache=KVCache(cache.keys, cache.values.double(), cache.lengths))
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        layer(*rows, cache=list(cache))
    with pytest.raises(TypeError, match="cache.lengths must be a torch.Tensor"):
        layer(*rows, cache=KVCache(cache.keys, cache.values, [0, 0, 0]))
    with pytest.raises(ValueError, match="cache.keys is on meta"):
        layer(*rows, cache=KVCache(cache.keys.to("meta"), cache.values, cache.lengths))
    with pytest.raises(TypeError, match="cache.lengths must be integers"):
        layer(*rows, cache=KVCache(cache.keys, cache.values, cache.lengths.float()))


def test_decoding_under_autocast_with_a_16_bit_cache():
    """Autocast projects in bfloat16, so the cache holds bfloat16 (init_cache's dtype)."""
    weights, layer, inputs = make(9)
    step_inputs = [x[:, :4] for x in inputs.values()]
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        with pytest.raises(TypeError, match="cache.keys dtype torch.float32 differs"):
            layer(*tensors(*step_inputs), causal=True, cache=layer.init_cache(3, 4))
        output, cache = layer(
            *tensors(*step_inputs),
            causal=True,
            cache=layer.init_cache(3, 4, dtype=torch.bfloat16),
        )
    assert output.dtype == cache.keys.dtype == torch.bfloat16
    expected = full_reference(
        weights, dict(zip(INPUT_NAMES, step_inputs, strict=True)), np.full(3, 4), **HEADS
    )
    np.testing.assert_allclose(output.float().numpy(), expected, rtol=0, atol=2e-2)


# -- random sequences of calls ----------------------------------------------------


@st.composite
def call_sequences(draw):
    """A layer, a cache and what is done to it: calls (ragged or not, NaN inputs),
    older caches called again, and values set in place, at any position."""
    batch, max_length = draw(st.integers(1, 3)), draw(st.sampled_from([5, 9, 70]))
    moves = []
    for _ in range(draw(st.integers(2, 12))):
        move = draw(st.sampled_from(["call", "call", "call", "older", "set"]))
        if move == "call":
            width = draw(st.integers(1, 3))
            ragged = draw(st.booleans())
            lens = [draw(st.integers(0, width)) for _ in range(batch)] if ragged else None
            nan = draw(st.none() | st.tuples(st.integers(0, batch - 1), st.integers(0, width - 1)))
            moves.append(("call", width, lens, draw(st.booleans()), nan))
        elif move == "older":
            moves.append(("older", draw(st.integers(0, 2**16))))
        else:
            where = (draw(st.integers(0, batch - 1)), draw(st.integers(0, max_length - 1)))
            moves.append(("set", draw(st.sampled_from(["keys", "values"])), where))
    return {
        "heads": draw(
            st.sampled_from([{"num_heads": 4}, HEADS, {"num_heads": 4, "num_kv_heads": 1}])
        ),
        "batch": batch,
        "max_length": max_length,
        "gpu": draw(st.booleans()),
        "mode": draw(st.sampled_from(["no_grad", "inference_mode"])),
        "moves": moves,
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(sequence=call_sequences())
def test_random_call_sequences_give_the_reference_numbers(sequence):
    """Every call of a sequence against the float64 reference, which keeps its own
    copy of what the cache's tensors hold: rows written in place stay past the
    lengths of an older cache of the same tensors, and a NaN set at any position
    reaches the output where the spec's attention over all positions lets it.
    Self-attention calls take the fast route where it answers, on the host and as
    on a GPU. (NaN, not infinities: an infinite query or key can make every
    visible score of a row -inf, where a call that attends over fewer positions
    than the spec differs from it, as the cache guide says.)"""
    heads, batch, max_length = sequence["heads"], sequence["batch"], sequence["max_length"]
    weights, layer = self_attention(heads, sequence["seed"] % 97)
    rng = np.random.default_rng(sequence["seed"])
    mode = getattr(torch, sequence["mode"])
    head_dim = NUM_HIDDENS // heads["num_heads"]
    kv_heads = heads.get("num_kv_heads", heads["num_heads"])
    with contextlib.ExitStack() as stack:
        if sequence["gpu"]:
            stack.enter_context(backend.as_if_on_a_gpu())
        stack.enter_context(mode())
        cache = layer.init_cache(batch, max_length)
        # The reference's copy of the tensors, and each lengths tensor's values.
        shape = (batch, kv_heads, max_length, head_dim)
        held = {"keys": np.zeros(shape), "values": np.zeros(shape)}
        lengths = {id(cache.lengths): np.zeros(batch, np.int64)}
        caches = [cache]
        for move in sequence["moves"]:
            if move[0] == "older":
                cache = caches[move[1] % len(caches)]
                continue
            if move[0] == "set":
                _, name, (b, position) = move
                getattr(cache, name)[b, 0, position, 0] = float("nan")
                held[name][b, 0, position, 0] = np.nan
                continue
            _, width, lens, causal, nan = move
            before = lengths[id(cache.lengths)]
            if (before + (width if lens is None else np.array(lens))).max() > max_length:
                continue
            x = rng.standard_normal((batch, width, NUM_HIDDENS)).astype(np.float32)
            if nan is not None:
                x[nan[0], nan[1], rng.integers(NUM_HIDDENS)] = np.nan
            t = torch.from_numpy(x)
            new_lens = None if lens is None else torch.tensor(lens)
            output, after = layer(t, t, t, new_lens, causal=causal, cache=cache)
            given_cache = spec.KVCache(held["keys"], held["values"], before)
            expected, _, returned = spec.reference_cached_forward(
                weights, x, x, x, given_cache, lens, **heads, causal=causal
            )
            got = output.numpy()
            np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
            np.testing.assert_allclose(got, expected, rtol=0, atol=FLOAT32_ATOL)
            assert after.lengths.tolist() == returned.lengths.tolist()
            held = {"keys": np.array(returned.keys), "values": np.array(returned.values)}
            lengths[id(after.lengths)] = np.array(returned.lengths)
            cache = after
            caches.append(cache)


def test_a_masked_call_bounds_its_scores_by_every_key_the_cache_holds():
    """A cache written in place knows its largest key below the rows written since a
    call read it (``CacheCheck.key_max``): a ragged call that writes a key of 5e5
    below the span an earlier call read takes it into the bound, and leaves SDPA
    (larger queries would give scores below the spec's -1e6) for the generic path;
    the first call, of small keys, runs SDPA. The reference's numbers both times."""
    weights, x = edges.scores_below_the_mask_value(2, 3, seed=3)
    layer = set_weights(MultiHeadAttention(4, 1, bias=False), weights).eval()
    x[..., 0] = 1.0
    keys = np.random.default_rng(4).standard_normal((2, 1, 4)).astype(np.float32)
    queries = keys.copy()
    keys[1, 0, 0] = 5e5  # example 1's, at its position 1: below the 3 positions read
    lens = np.array([3, 1])
    cache = layer.init_cache(2, 4)
    reference = spec.KVCache(np.zeros((2, 1, 4, 4)), np.zeros((2, 1, 4, 4)), np.zeros(2))
    ran = []
    for args, new_lens in (((x, x, x), lens), ((queries, keys, keys), None)):
        given = [torch.from_numpy(a) for a in args]
        with backend.kernel_spy() as calls, torch.no_grad():
            out, cache = layer(
                *given, None if new_lens is None else torch.from_numpy(new_lens), cache=cache
            )
        ran.append(len(calls))
        expected, _, reference = spec.reference_cached_forward(
            weights, *args, reference, new_lens, num_heads=1
        )
        # (Padding rows are free.)
        real = np.ones(args[0].shape[:2], bool)
        if new_lens is not None:
            real = np.arange(args[0].shape[1])[None, :] < new_lens[:, None]
        np.testing.assert_allclose(out.numpy()[real], expected[real], rtol=1e-5, atol=1e-3)
    assert ran == [1, 0]
