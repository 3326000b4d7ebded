"""torch.func's transforms over the layer: ``vmap`` over examples and per-example gradients.

Under ``torch.vmap`` no value can be read, so a call reads nothing, as a GPU's
does (the generic path), and the packed projections are stacked by a copy
that the transforms batch and differentiate (docs: "Fast paths").
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch.func import functional_call, grad, vmap

from mha_multi import spec
from mha_multi.parity.harness.torch import as_if_on_a_gpu
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights
from mha_multi.weights import init_weights

LAYERS = {
    "plain": {},
    "rotary, grouped": {"rotary": {"theta": 100.0}, "num_kv_heads": 1},
}


def _layer(options):
    weights = init_weights(16, seed=3, num_heads=2, num_kv_heads=options.get("num_kv_heads"))
    return set_weights(MultiHeadAttention(16, 2, **options).double(), weights)


@pytest.mark.parametrize("options", LAYERS.values(), ids=LAYERS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("recording", [True, False], ids=["recording", "no gradient"])
def test_vmap_over_examples_gives_the_references_numbers(options, causal, recording):
    """Without a gradient, self-attention's fast route is asked first: its read of a
    batched value fails, and the call takes the generic flow."""
    layer = _layer(options)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 16))
    lens = np.array([1, 2, 3, 0])

    def one(xi, li):
        return layer(xi[None], xi[None], xi[None], li[None], causal=causal)[0]

    with torch.set_grad_enabled(recording):
        out = vmap(one)(torch.from_numpy(x), torch.from_numpy(lens))
        plain = vmap(lambda xi: layer(*(xi[None],) * 3, causal=causal)[0])(torch.from_numpy(x))
    expected, _ = spec.reference_forward(
        get_weights(layer), x, x, x, lens, num_heads=2, causal=causal, **options
    )
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-10, atol=1e-12)
    expected, _ = spec.reference_forward(
        get_weights(layer), x, x, x, num_heads=2, causal=causal, **options
    )
    np.testing.assert_allclose(plain.detach().numpy(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", LAYERS.values(), ids=LAYERS)
def test_per_example_gradients_are_those_of_each_example_alone(options):
    layer = _layer(options)
    params = {name: p.detach() for name, p in layer.named_parameters()}
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((3, 2, 16)))

    def loss(p, xi):
        out = functional_call(layer, p, (xi[None], xi[None], xi[None]), {"causal": True})
        return (out**2).sum()

    batched = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(3):
        layer.zero_grad()
        (layer(x[[i]], x[[i]], x[[i]], causal=True) ** 2).sum().backward()
        for name, p in layer.named_parameters():
            np.testing.assert_allclose(
                batched[name][i].numpy(), p.grad.numpy(), rtol=1e-10, atol=1e-12
            )


@pytest.mark.parametrize("options", LAYERS.values(), ids=LAYERS)
def test_vmap_over_cached_calls_of_one_cache_makes_each_example_its_own(options):
    """One cache (not batched) for every example: no example writes into it, and each
    gets the cache and the output of its call alone (the functional update)."""
    layer = _layer(options)
    x = np.random.default_rng(1).standard_normal((3, 2, 4, 16))
    cache = layer.init_cache(2, 6)

    def one(xi):
        output, updated = layer(xi, xi, xi, causal=True, cache=cache)
        return output, updated.keys, updated.lengths

    with torch.no_grad():
        out, keys, lengths = vmap(one)(torch.from_numpy(x))
    assert not cache.keys.any() and not cache.lengths.any()  # the given cache as it was
    assert lengths.tolist() == [[4, 4]] * 3
    weights = get_weights(layer)
    for i in range(3):
        empty = spec.KVCache(np.zeros(cache.keys.shape), np.zeros(cache.keys.shape), np.zeros(2))
        expected, _, written = spec.reference_cached_forward(
            weights, x[i], x[i], x[i], empty, num_heads=2, causal=True, **options
        )
        np.testing.assert_allclose(out[i].numpy(), expected, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(keys[i].numpy(), written.keys, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", LAYERS.values(), ids=LAYERS)
def test_vmap_over_decoding_with_a_cache_per_example(options):
    """Each example's cache batched along with it: a prompt and two steps, whose lengths
    no read may take (the call does what compiled code does), give the reference's
    numbers."""
    layer = _layer(options)
    x = np.random.default_rng(2).standard_normal((3, 2, 5, 16))
    caches = [layer.init_cache(2, 6) for _ in range(3)]
    held = [torch.stack(arrays) for arrays in zip(*caches, strict=True)]

    def one(xi, keys, values, lengths):
        output, updated = layer(xi, xi, xi, causal=True, cache=spec.KVCache(keys, values, lengths))
        return output, *updated

    outputs = []
    with torch.no_grad():
        for start, stop in ((0, 3), (3, 4), (4, 5)):
            output, *held = vmap(one)(torch.from_numpy(x[:, :, start:stop]), *held)
            outputs.append(output.numpy())
    assert held[2].tolist() == [[5, 5]] * 3
    for i in range(3):
        expected, _ = spec.reference_forward(
            get_weights(layer), x[i], x[i], x[i], num_heads=2, causal=True, **options
        )
        generated = np.concatenate([o[i] for o in outputs], axis=1)
        np.testing.assert_allclose(generated, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "options", {**LAYERS, "soft-capped": {"softcap": 30.0}}.values(), ids=[*LAYERS, "soft-capped"]
)
@pytest.mark.parametrize("gpu", [False, True], ids=["host", "as on a GPU"])
@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
def test_vmap_over_decoding_steps_of_one_cache_leaves_it_as_it_was(options, gpu, ragged):
    """A prompt written in place, then one decoding step of several candidate tokens
    under ``vmap`` over that one cache: the steps the route would take eagerly (its
    check holds the cache) write nothing in place there, and each candidate gets the
    reference's output and a cache of its own."""
    layer = _layer(options).eval()
    rng = np.random.default_rng(4)
    prompt, tokens = rng.standard_normal((2, 3, 16)), rng.standard_normal((3, 2, 1, 16))
    lens = np.array([3, 2]) if ragged else None
    with as_if_on_a_gpu() if gpu else contextlib.nullcontext(), torch.no_grad():
        x = torch.from_numpy(prompt)
        valid_lens = None if lens is None else torch.from_numpy(lens)
        _, cache = layer(x, x, x, valid_lens, causal=True, cache=layer.init_cache(2, 6))
        before = [array.clone() for array in cache]

        def one(token):
            output, updated = layer(token, token, token, causal=True, cache=cache)
            return output, updated.lengths

        out, lengths = vmap(one)(torch.from_numpy(tokens))
    for array, kept in zip(cache, before, strict=True):
        assert torch.equal(array, kept)
    filled = np.array([3, 2] if ragged else [3, 3])
    assert lengths.tolist() == [(filled + 1).tolist()] * 3
    weights = get_weights(layer)
    held = spec.KVCache(*(array.numpy() for array in before))
    for i in range(3):
        expected, _, _ = spec.reference_cached_forward(
            weights, tokens[i], tokens[i], tokens[i], held, num_heads=2, causal=True, **options
        )
        np.testing.assert_allclose(out[i].numpy(), expected, rtol=1e-10, atol=1e-12)
