"""What the PyTorch cache's test modules share: a grouped-heads layer, inputs, decoding loops."""

from __future__ import annotations

import numpy as np
import torch
from torch_support import draw_norm_weights

from mha_multi import spec
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

#: Grouped heads and biases: two query heads read each key/value head.
HEADS = {"num_heads": 4, "num_kv_heads": 2}
NUM_HIDDENS, QUERY_SIZE, HEAD_DIM = 16, 5, 4
#: A ragged prefill, steps of 1 (with idle examples) and a chunk of 3.
CHUNKS = [(4, [4, 2, 0]), (1, [1, 1, 1]), (1, [1, 0, 1]), (3, [2, 3, 3]), (1, [1, 1, 0])]
LENGTHS = np.array([9, 7, 5])
FLOAT32_ATOL = 5e-6
#: Rotary embeddings a decoding route takes: none, half-split, interleaved pairs of a part.
ROUTE_ROTARY = [None, {"theta": 100.0}, {"theta": 50.0, "fraction": 0.5, "interleaved": True}]


def make(seed: int, dtype: torch.dtype = torch.float32, length: int = 9):
    """Float64 weights (float32 values), the layer holding them, and inputs of 3 examples.

    The queries are ``QUERY_SIZE`` wide, keys and values ``NUM_HIDDENS``.
    """
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


def prefilled(layer, inputs, new_lens, max_length=7):
    """A cache after one call of ``inputs``' first 3 positions, ``new_lens`` of them kept."""
    cache = layer.init_cache(3, max_length)
    rows = tensors(*(x[:, :3] for x in inputs.values()), new_lens, dtype=layer.W_o.weight.dtype)
    with torch.no_grad():
        _, cache = layer(*rows, causal=True, cache=cache)
    return cache


def self_attention(heads, seed, dtype=torch.float32, **options):
    """A self-attention layer (every input of ``NUM_HIDDENS``) and its float64 weights
    (with ``qk_norm``, the norms' weights drawn around 1; with ``sinks``, logits drawn)."""
    sinks = bool(options.get("sinks"))
    weights = init_weights(NUM_HIDDENS, bias=True, seed=seed, sinks=sinks, **heads)
    layer = MultiHeadAttention(NUM_HIDDENS, bias=True, dtype=dtype, **heads, **options)
    if options.get("qk_norm") is not None:
        draw_norm_weights(weights, layer, np.random.default_rng(seed))
    layer = set_weights(layer, {k: v.astype(np.float32) for k, v in weights.items()}).eval()
    return {k: v.astype(np.float32).astype(np.float64) for k, v in weights.items()}, layer


def feed_back(layer, prompt, steps, max_length, new_lens=None, *, check=None, cache=None):
    """Decodes ``steps`` tokens, each step's input the last output; returns outputs and caches.

    ``check(step_input, cache_before, output)`` is called at every step,
    with the cache before the step as numpy (the step writes in place).
    ``cache``: the cache the prompt is written into (``None``: ``layer.init_cache``'s).
    """
    dtype = layer.W_o.weight.dtype
    if cache is None:
        cache = layer.init_cache(3, max_length)
    with torch.no_grad():
        x = torch.from_numpy(prompt).to(dtype)
        lens = None if new_lens is None else torch.from_numpy(new_lens)
        output, cache = layer(x, x, x, lens, causal=True, cache=cache)
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


def assert_same_decoding(ours, theirs):
    """Two :func:`feed_back` runs' outputs and last caches equal to the bit."""
    (outputs, caches), (other_outputs, other_caches) = ours, theirs
    for a, b in zip([*outputs, *caches[-1]], [*other_outputs, *other_caches[-1]], strict=True):
        assert torch.equal(a, b)
