"""transformers' Llama, Mistral, Gemma 2, Phi-3 and BLOOM attention blocks, in every backend.

Each block was built small from its model's config (random weights) and
run in float64 by transformers on a ragged, left-padded batch with its
``position_ids`` (``tests/fixtures/transformers_blocks.py``; the PyTorch
tests check that the file still holds what transformers computes). Every
backend's layer, built from :func:`mha_multi.interop.llama.from_llama`'s
arguments and weights (BLOOM's fused projection split in the fixture),
must give the block's output and input gradient in float32 within the
parity tolerances: rotary embeddings with Llama 3's
scaling (Llama), a sliding window (Mistral), soft-capped scores, a window
and a scale of its own (Gemma 2), a fused ``qkv_proj`` with partial rotary
and a window (Phi-3), ALiBi (BLOOM).
"""

from __future__ import annotations

import numpy as np
import pytest
from transformers_blocks import HIDDEN, MODELS, load

from mha_multi.parity.compare import TOLERANCES

FORWARD, GRADIENT = TOLERANCES["float32"]


@pytest.fixture(scope="module")
def fixture():
    return load()


@pytest.mark.parametrize("model", list(MODELS))
def test_block_output_and_input_gradient(runner, fixture, model):
    data, block = fixture["batch"], fixture[model]
    kwargs = dict(block["kwargs"])
    layer = runner.set_weights(
        runner.make_layer(HIDDEN, kwargs.pop("num_heads"), **kwargs), block["weights"]
    )
    # Three arrays of the same values: gradients are taken of each.
    x = [runner.to_native(data["x"]) for _ in range(3)]
    options = {
        "positions": runner.native_lens(data["positions"]),
        # Left padding: the padded keys biased away, as transformers' mask does.
        "bias": runner.to_native(data["bias"]),
    }
    output = runner.to_numpy(runner.forward(layer, *x, None, causal=True, **options))
    real = data["real"][..., None]
    error = np.abs(np.where(real, output, 0.0) - block["output"]).max()
    assert error <= FORWARD, f"{model} output: {error:.3g}"
    grads = runner.vjp(
        layer,
        *x,
        None,
        causal=True,
        output_gradient=runner.to_native(data["output_gradient"]),
        **options,
    )
    # Self-attention: the input's gradient is that of the queries, keys and values.
    grad_x = sum(runner.to_numpy(grads[name]) for name in ("queries", "keys", "values"))
    error = np.abs(grad_x - block["grad.x"]).max()
    assert error <= GRADIENT, f"{model} input gradient: {error:.3g}"


#: Each example's real tokens fed to the cache in calls of 3, 1, 1 and 2 new
#: positions (examples of 7, 4 and 5 tokens: ragged, some calls append nothing).
CHUNKS = [(3, [3, 3, 3]), (1, [1, 1, 1]), (1, [1, 0, 1]), (2, [2, 0, 0])]


@pytest.mark.parametrize("model", list(MODELS))
def test_cached_decoding_gives_the_block_output(runner, fixture, model):
    """The real tokens of each example, decoded through the layer's cache call by call,
    give the block's output of one forward (a rotary type that depends on the call's
    length is left out: its angles change with each call's length, as transformers'
    do, docs: "Positions and biases")."""
    data, block = fixture["batch"], fixture[model]
    kwargs = dict(block["kwargs"])
    scaling = (kwargs.get("rotary") or {}).get("scaling") or {}
    if scaling.get("rope_type") in ("dynamic", "longrope"):
        pytest.skip(f"{model}: its rotary angles depend on each call's length")
    layer = runner.set_weights(
        runner.make_layer(HIDDEN, kwargs.pop("num_heads"), **kwargs), block["weights"]
    )
    lengths = data["real"].sum(axis=1)
    # Left padding removed: each example's real tokens from position 0.
    x = np.zeros_like(data["x"])
    expected = np.zeros_like(block["output"])
    for b, length in enumerate(lengths):
        x[b, :length] = data["x"][b, -length:]
        expected[b, :length] = block["output"][b, -length:]
    inputs = {"queries": x, "keys": x, "values": x}
    output = runner.decode(layer, inputs, lengths, CHUNKS, max_length=x.shape[1])
    error = np.abs(output - expected).max()
    assert error <= FORWARD, f"{model} cached decoding: {error:.3g}"
