"""PyTorch's key/value cache under ``torch.compile``: one graph per chunk length, eager numbers.

The generic cache tests (every dtype, random schedules, the per-query loop,
errors) are ``tests/backends/test_cache.py``'s; here every result is checked
against the float64 reference as well, and an overflow, which eager calls
refuse, drops positions and keeps counting.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cache_support import (
    CHUNKS,
    FLOAT32_ATOL,
    HEAD_DIM,
    HEADS,
    LENGTHS,
    NUM_HIDDENS,
    held,
    make,
    projected_heads,
    self_attention,
    stepper,
    tensors,
)
from torch._dynamo.testing import CompileCounterWithBackend
from torch_support import compiler as compiler

from mha_multi.parity.decode import decode, full_reference
from mha_multi.spec import KVCache


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


#: Layers of today's families (grouped heads): plain, Llama's, Gemma 2's window and cap,
#: gpt-oss's window and sinks, Qwen 3's norms, ALiBi.
COMPILED_LAYERS = {
    "plain": {},
    "rotary": {"rotary": {"theta": 100.0}},
    "rotary-window-softcap": {"rotary": {"theta": 100.0}, "window": 3, "softcap": 5.0},
    "rotary-window-sinks": {"rotary": {"theta": 100.0}, "window": 3, "sinks": True},
    "rotary-norms": {"rotary": {"theta": 100.0}, "qk_norm": {}},
    "alibi": {"alibi": True},
}


@pytest.mark.parametrize("options", COMPILED_LAYERS.values(), ids=COMPILED_LAYERS.keys())
def test_compiled_self_attention_steps_are_one_graph_of_the_eager_numbers(options):
    """A decoding step of self-attention, plain, Llama-shaped (rotary, grouped heads) and
    with the options of today's families, traces to one graph without a break
    (``torch._dynamo.explain``), static shapes; the compiled prefill and steps give the
    eager numbers."""
    _, layer = self_attention(HEADS, seed=15, **options)
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


@pytest.mark.parametrize("layout", ["expanded", "same", "interleaved", "stacked"])
def test_compiled_calls_write_a_cache_whose_elements_share_memory_as_new_arrays(layout):
    """As an eager call (test_torch_cache_eager.py): a cache whose elements share
    memory (one example's arrays expanded to every example, one array as both keys and
    values, keys and values interleaved in one buffer) gets new arrays, with the spec's
    numbers, and is left as it was; compiled in place, one example's rows landed on
    another's. Keys and values stacked apart in one buffer are written in place."""
    weights, layer, inputs = make(5)
    if layout == "expanded":
        keys, values = (x.expand(3, -1, -1, -1) for x in layer.init_cache(1, 9)[:2])
    elif layout == "same":
        keys = values = layer.init_cache(3, 9).keys
    elif layout == "interleaved":
        buffer = torch.zeros(3, 2, 9, HEAD_DIM, 2)  # (B, H_kv, max_length, dh, keys|values)
        keys, values = buffer[..., 0], buffer[..., 1]
    else:
        keys, values = torch.zeros(2, 3, 2, 9, HEAD_DIM)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True, dynamic=False)
    step, caches = stepper(compiled, KVCache(keys, values, torch.zeros(3, dtype=torch.int32)))
    output = decode(step, inputs, LENGTHS, CHUNKS)

    np.testing.assert_allclose(
        output, full_reference(weights, inputs, LENGTHS, **HEADS), rtol=0, atol=FLOAT32_ATOL
    )
    in_place = layout == "stacked"
    assert (caches[1].keys is keys and caches[1].values is values) == in_place
    assert keys.any() == values.any() == in_place
