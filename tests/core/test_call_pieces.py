"""The generic path's batch in pieces, decided once for every framework
(:meth:`mha_multi.call.Facts.generic_attention`, docs: "Fast paths").

A framework whose facts give ``map_pieces`` and answer more than one piece
gets the whole batch's numbers piece by piece: checked here on numpy against
a naive per-example, per-head loop in float64, and against the whole batch's
generic path to the bit. Where the batch must stay whole (dropout, score
options, heads split over devices), the pieces are not asked for.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mha_multi import call, spec

OPS = spec.NumpyOps()
HEADS = spec.Heads(4, 2, 3)  # query heads, key/value heads, head_dim


def _numpy_map(function, stacked):
    """``lax.map``'s contract on numpy: ``function`` of each piece, outputs stacked."""
    count = stacked[0].shape[0]
    results = [function(tuple(None if x is None else x[i] for x in stacked)) for i in range(count)]
    return tuple(
        None if results[0][j] is None else np.stack([r[j] for r in results])
        for j in range(len(results[0]))
    )


class _PiecedFacts(call.Facts):
    """Facts of a framework that takes ``pieces`` pieces, recording each question."""

    map_pieces = staticmethod(_numpy_map)

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces
        self.asked: list[int] = []

    def batch_pieces(self, q: Any, example_bytes: int) -> int:
        self.asked.append(example_bytes)
        return self.pieces


def _naive(q, k, v, valid_lens, causal):
    """Each example and head alone, in float64: hidden scores replaced by -1e6."""
    batch, num_queries, _ = q.shape
    num_keys = k.shape[1]
    heads, dh = HEADS.num_heads, HEADS.head_dim
    group = heads // HEADS.num_kv_heads
    context = np.zeros((batch, num_queries, heads * dh))
    for b in range(batch):
        for h in range(heads):
            g = h // group
            qh = q[b, :, h * dh : (h + 1) * dh]
            kh, vh = k[b, :, g * dh : (g + 1) * dh], v[b, :, g * dh : (g + 1) * dh]
            scores = qh @ kh.T / np.sqrt(dh)
            for i in range(num_queries):
                for j in range(num_keys):
                    hidden = valid_lens is not None and j >= valid_lens[b]
                    hidden = hidden or (causal and j > i + num_keys - num_queries)
                    if hidden:
                        scores[i, j] = -1e6
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            context[b, :, h * dh : (h + 1) * dh] = weights @ vh
    return context


def _inputs(batch=6, num_queries=5, num_keys=5):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, num_queries, HEADS.query_features))
    k, v = (rng.standard_normal((batch, num_keys, HEADS.kv_features)) for _ in "kv")
    valid_lens = rng.integers(1, num_keys + 1, batch)
    return q, k, v, valid_lens


def _settings(**changes):
    settings = {
        "heads": HEADS,
        "causal": True,
        "dropout": None,
        "kv_split": False,
        "head_parallel": False,
        "return_attention_weights": False,
    }
    return {**settings, **changes}


@pytest.mark.parametrize("weighted", [False, True], ids=["context", "with weights"])
@pytest.mark.parametrize("pieces", [2, 3, 6])
def test_pieces_give_the_whole_batchs_numbers(pieces, weighted):
    q, k, v, valid_lens = _inputs()
    facts = _PiecedFacts(pieces)
    settings = _settings(return_attention_weights=weighted)
    context, weights = facts.generic_attention(OPS, q, k, v, valid_lens, **settings)
    # Asked once, with one example's float32 scores (H, Q, K).
    assert facts.asked == [HEADS.num_heads * 5 * 5 * 4]
    np.testing.assert_allclose(context, _naive(q, k, v, valid_lens, True), atol=1e-12, rtol=0)
    whole_context, whole_weights = call.Facts().generic_attention(
        OPS, q, k, v, valid_lens, **settings
    )
    np.testing.assert_array_equal(context, whole_context)
    if weighted:
        np.testing.assert_array_equal(weights, whole_weights)
    else:
        assert weights is None


def test_a_cache_split_into_heads_is_taken_in_pieces_alike():
    q, k, v, valid_lens = _inputs(num_queries=2, num_keys=7)
    split = [
        x.reshape(6, 7, HEADS.num_kv_heads, HEADS.head_dim).transpose(0, 2, 1, 3) for x in (k, v)
    ]
    facts = _PiecedFacts(3)
    context, _ = facts.generic_attention(OPS, q, *split, valid_lens, **_settings(kv_split=True))
    assert facts.asked == [HEADS.num_heads * 2 * 7 * 4]
    np.testing.assert_allclose(context, _naive(q, k, v, valid_lens, True), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "changes",
    [
        {"dropout": lambda weights: weights},
        {"options": spec.ScoreOptions(softcap=5.0)},
        {"head_parallel": True},
    ],
    ids=["dropout (one mask for the batch)", "score options", "heads split over devices"],
)
def test_the_batch_stays_whole_where_pieces_would_change_it(changes):
    q, k, v, valid_lens = _inputs()
    facts = _PiecedFacts(3)
    facts.generic_attention(OPS, q, k, v, valid_lens, **_settings(**changes))
    assert facts.asked == []
