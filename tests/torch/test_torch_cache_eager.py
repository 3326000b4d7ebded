"""PyTorch's eager cached calls: writes in place, gradients through the cache, its arguments.

Calls without gradients write the cache's own tensors; calls recording them
leave the given cache as it was and differentiate like one full causal
forward. The generic cache tests are ``tests/backends/test_cache.py``'s; here
every result is checked against the float64 reference as well.
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
    prefilled,
    projected_heads,
    stepper,
    tensors,
)

from mha_multi.parity.decode import (
    INPUT_NAMES,
    chunk_index,
    decode,
    full_reference,
    full_reference_gradients,
)
from mha_multi.torch import KVCache, MultiHeadAttention, set_weights

# -- eager writes in place -----------------------------------------------------


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


@pytest.mark.parametrize("layout", ["expanded", "interleaved", "stacked"])
def test_a_cache_whose_elements_share_memory_is_written_as_new_arrays(layout):
    """A cache whose elements share memory (one example's arrays expanded to every
    example, as sampling several continuations of one prompt makes them; keys and
    values interleaved in one buffer) would have its rows written over each other in
    place: its first call writes new arrays instead, with the spec's numbers, and
    leaves the given ones as they were. Keys and values stacked apart in one buffer
    are written in place."""
    weights, layer, inputs = make(5)
    if layout == "expanded":
        keys, values = (x.expand(3, -1, -1, -1) for x in layer.init_cache(1, 9)[:2])
    elif layout == "interleaved":
        buffer = torch.zeros(3, 2, 9, HEAD_DIM, 2)  # (B, H_kv, max_length, dh, keys|values)
        keys, values = buffer[..., 0], buffer[..., 1]
    else:
        keys, values = torch.zeros(2, 3, 2, 9, HEAD_DIM)
    step, caches = stepper(layer, KVCache(keys, values, torch.zeros(3, dtype=torch.int32)))
    output = decode(step, inputs, LENGTHS, CHUNKS)

    np.testing.assert_allclose(
        output, full_reference(weights, inputs, LENGTHS, **HEADS), rtol=0, atol=FLOAT32_ATOL
    )
    in_place = layout == "stacked"
    assert (caches[1].keys is keys and caches[1].values is values) == in_place
    assert keys.any() == values.any() == in_place


# -- autograd through the cache ------------------------------------------------


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
        index = torch.from_numpy(chunk_index(consumed, num_new, 9))[..., None]
        rows = [torch.take_along_dim(full[name], index, dim=1) for name in INPUT_NAMES]
        output, cache = layer(*rows, torch.tensor(new_lens), causal=True, cache=cache)
        for b, n in enumerate(new_lens):
            loss = loss + (output[b, :n] * gradient[b, consumed[b] : consumed[b] + n]).sum()
        consumed += new_lens
    loss.backward()

    expected = full_reference_gradients(weights, inputs, LENGTHS, output_gradient, **HEADS)
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


# -- the cache's own arguments -------------------------------------------------


def test_init_cache_takes_a_floating_dtype():
    _, layer, _ = make(7)
    cache = layer.init_cache(2, 5, dtype=torch.bfloat16)
    assert cache.keys.dtype == cache.values.dtype == torch.bfloat16
    assert cache.lengths.dtype == torch.int32
    assert layer.double().init_cache(1, 2).keys.dtype == torch.float64
    for dtype in (torch.int64, "float32"):
        with pytest.raises(TypeError, match="must be a floating dtype of the layer.s framework"):
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


@pytest.mark.parametrize("qk_norm", [None, "input", "float32"])
def test_decoding_under_autocast_with_a_16_bit_cache(qk_norm):
    """Autocast projects in bfloat16, so the cache holds bfloat16 (init_cache's dtype),
    query/key norms too: a norm's float32 gain (a float32 layer's) gave float32 keys
    beside bfloat16 values, and no cache held both."""
    weights, layer, inputs = make(9)
    if qk_norm is not None:
        norm = {"eps": 1e-6, "product": qk_norm}
        rng = np.random.default_rng(9)
        weights = {
            **weights,
            "q_norm": 1 + 0.3 * rng.standard_normal(HEAD_DIM),
            "k_norm": 1 + 0.3 * rng.standard_normal(HEAD_DIM),
        }
        layer = MultiHeadAttention(NUM_HIDDENS, bias=True, qk_norm=norm, **HEADS).eval()
        layer = set_weights(layer, {k: v.astype(np.float32) for k, v in weights.items()})
        weights = {k: v.astype(np.float32).astype(np.float64) for k, v in weights.items()}
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
    options = {} if qk_norm is None else {"qk_norm": norm}
    expected = full_reference(
        weights,
        dict(zip(INPUT_NAMES, step_inputs, strict=True)),
        np.full(3, 4),
        **HEADS,
        **options,
    )
    np.testing.assert_allclose(output.float().numpy(), expected, rtol=0, atol=2e-2)
