"""SDPA for PyTorch's eager cached calls: the plan's mask, and the reads that decide the kernel.

Grouped heads reach SDPA unrepeated in the cache's own layout; what a call
reads (non-finite entries, edits in place, the new rows only, the largest key
held) sends it to the generic path where SDPA would differ from the spec.
Every result is the float64 cached reference's.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from cache_support import FLOAT32_ATOL, HEAD_DIM, HEADS, make, prefilled, tensors
from torch_support import sdpa_spy

from mha_multi import spec
from mha_multi.parity.decode import chunk_rows, full_reference
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import KVCache, MultiHeadAttention, _cache, _reads, set_weights
from tests.backends import test_edges as edges


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
