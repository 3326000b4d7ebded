"""Random sequences of PyTorch cached calls, each call against the float64 reference.

Calls ragged or not, with NaN inputs, older caches called again and values
set in place at any position, on the host and as on a GPU (hypothesis; the
generic random schedules are ``tests/backends/test_cache.py``'s).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from cache_support import FLOAT32_ATOL, HEADS, NUM_HIDDENS, self_attention
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mha_multi import spec
from mha_multi.parity.harness import torch as backend


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
