"""A compiled PyTorch cached call writes its new rows into the cache's own tensors.

Under ``torch.compile``, with no gradient recorded through the cache, the
update is the spec's (:func:`mha_multi.spec.update_cache`) for every input,
made in place by one indexed write per array (docs: "Generating with a cache",
"Errors, and what compiled code does"); checked against the spec's update,
a loop of the docs' rule and the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha_multi import spec
from mha_multi.spec.reference import reference_cached_forward
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.torch._compiled_cache import write_in_place
from mha_multi.torch._ops import OPS
from mha_multi.weights import init_weights

NUM_HIDDENS, HEADS, HEAD_DIM = 16, {"num_heads": 4, "num_kv_heads": 2}, 4
ROTARY = {"theta": 100.0}
FLOAT32_ATOL = 5e-6


def rule_of_the_docs(keys, values, lengths, k, v, valid_lens):
    """The update as the docs say it, one row at a time: row ``t`` of example ``b`` at
    ``lengths[b] + t`` for ``t`` below ``valid_lens[b]`` (clipped into ``[0, T]``),
    where that position is in ``[0, max_length)``; lengths count every row."""
    keys, values = keys.copy(), values.copy()
    batch, num_new = k.shape[:2]
    new = np.full(batch, num_new) if valid_lens is None else np.clip(valid_lens, 0, num_new)
    for b in range(batch):
        for t in range(new[b]):
            at = lengths[b] + t
            if 0 <= at < keys.shape[2]:
                keys[b, :, at] = k[b, t].reshape(-1, HEAD_DIM)
                values[b, :, at] = v[b, t].reshape(-1, HEAD_DIM)
    return keys, values, lengths + new


def random_write(rng):
    """A cache and new rows of random sizes, lengths anywhere (negative, past
    ``max_length``), ``valid_lens`` anywhere or ``None``."""
    max_length, num_new = int(rng.integers(0, 6)), int(rng.integers(0, 8))
    shape = (3, HEADS["num_kv_heads"], max_length, HEAD_DIM)
    keys, values = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    lengths = rng.integers(-3, max_length + 4, 3).astype(np.int32)
    rows = (3, num_new, HEADS["num_kv_heads"] * HEAD_DIM)
    k, v = (rng.standard_normal(rows).astype(np.float32) for _ in range(2))
    valid_lens = None if rng.random() < 0.25 else rng.integers(-2, num_new + 3, 3)
    return keys, values, lengths, k, v, valid_lens


@pytest.mark.parametrize("causal", [False, True])
def test_the_in_place_write_is_the_spec_update_for_any_lengths(causal):
    """Bit for bit the spec's functional update, and the docs' rule, for 40 random
    writes; the returned cache is the given tensors, written."""
    rng = np.random.default_rng(int(causal))
    for _ in range(40):
        keys, values, lengths, k, v, valid_lens = random_write(rng)
        given = [torch.from_numpy(x.copy()) for x in (keys, values, lengths)]
        args = [torch.from_numpy(x) for x in (k, v)]
        args.append(None if valid_lens is None else torch.from_numpy(valid_lens))
        options = {"head_dim": HEAD_DIM, "causal": causal}
        expected, expected_seen = spec.update_cache(OPS, spec.KVCache(*given), *args, **options)
        cache = spec.KVCache(*given)
        written, seen = write_in_place(OPS, cache, *args, **options)

        assert written.keys is cache.keys and written.values is cache.values
        for got, want in zip((*written, seen), (*expected, expected_seen), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        looped = rule_of_the_docs(keys, values, lengths, k, v, valid_lens)
        for got, want in zip(written, looped, strict=True):
            np.testing.assert_array_equal(got.numpy(), want)


def rotary_layer():
    weights = init_weights(NUM_HIDDENS, seed=4, **HEADS)
    layer = MultiHeadAttention(NUM_HIDDENS, rotary=ROTARY, **HEADS)
    return weights, set_weights(layer, weights).eval()


def test_a_compiled_call_writes_the_given_cache_with_the_reference_numbers():
    """One inductor graph, called twice: ragged lengths and ``valid_lens`` (the float64
    reference's output and cache), then past ``max_length`` (what fits is written,
    nothing held changes, lengths count on: the reference over a longer cache, cut)."""
    weights, layer = rotary_layer()
    rng = np.random.default_rng(3)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    max_length, num_new = 6, 3
    held = rng.standard_normal((2, 3, 2, max_length, HEAD_DIM)).astype(np.float32)
    for lengths, valid_lens in (([0, 2, 3], [3, 1, 2]), ([4, 5, 6], [3, 2, 1])):
        lengths, valid_lens = np.array(lengths, np.int32), np.array(valid_lens)
        x = rng.standard_normal((3, num_new, NUM_HIDDENS)).astype(np.float32)
        cache = spec.KVCache(*(torch.from_numpy(a.copy()) for a in (*held, lengths)))
        with torch.no_grad():
            out, written = compiled(
                *[torch.from_numpy(x)] * 3, torch.from_numpy(valid_lens), causal=True, cache=cache
            )
        assert written.keys is cache.keys and written.values is cache.values
        # The reference refuses an overflow: over room for every row, then cut.
        longer = [np.pad(a, [(0, 0)] * 2 + [(0, num_new), (0, 0)]) for a in held]
        reference = reference_cached_forward(
            weights, x, x, x, spec.KVCache(*longer, lengths), valid_lens,
            causal=True, rotary=ROTARY, **HEADS,
        )  # fmt: skip
        expected = reference[2]
        assert written.lengths.tolist() == expected.lengths.tolist()
        for got, want in zip(cache[:2], expected[:2], strict=True):
            np.testing.assert_allclose(got, want[:, :, :max_length], rtol=0, atol=FLOAT32_ATOL)
        if (lengths + valid_lens <= max_length).all():
            np.testing.assert_allclose(out, reference[0], rtol=0, atol=FLOAT32_ATOL)


@pytest.mark.parametrize("rotary", [None, ROTARY], ids=["plain", "rotary"])
def test_a_compiled_step_is_one_graph_that_writes_into_the_cache_in_place(rotary):
    """``torch._dynamo.explain``: no graph break, and the step's write is one in-place
    ``index_put_`` per array; where a gradient is recorded, the functional update."""
    layer = MultiHeadAttention(NUM_HIDDENS, rotary=rotary, **HEADS)
    set_weights(layer, init_weights(NUM_HIDDENS, seed=5, **HEADS)).eval()
    y = torch.ones(2, 1, NUM_HIDDENS)
    for recording in (False, True):
        cache = layer.init_cache(2, 8)
        with torch.set_grad_enabled(recording):
            explained = torch._dynamo.explain(layer)(y, y, y, causal=True, cache=cache)
        assert explained.graph_count == 1 and explained.graph_break_count == 0
        graph = explained.graphs[0].graph
        writes = [node for node in graph.nodes if node.target == "index_put_"]
        assert len(writes) == (0 if recording else 2), graph
