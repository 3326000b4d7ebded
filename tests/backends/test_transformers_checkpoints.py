"""Checkpoints saved by transformers, converted with numpy alone, in every backend.

Each folder of ``tests/fixtures/checkpoints/`` (Llama 3, Qwen 3, Gemma 3 in
bfloat16, gpt-oss sharded) is read by
:func:`mha_multi.interop.transformers.attention_layers`; each layer, built by
the backend's ``MultiHeadAttention.from_canonical(weights, **kwargs)`` (the
Linen module through its runner), must give its transformers block's float64
output (``tests/fixtures/transformers_checkpoints.py``) within the float32
tolerance.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from transformers_blocks import HIDDEN, batch
from transformers_checkpoints import CHECKPOINTS, FOLDERS, results

from mha_multi import spec
from mha_multi.heads import prune_heads
from mha_multi.interop.transformers import attention_layers
from mha_multi.parity.compare import TOLERANCES
from mha_multi.weights import init_weights

FORWARD, _ = TOLERANCES["float32"]


@pytest.mark.parametrize("model", list(CHECKPOINTS))
def test_each_converted_layer_computes_its_block(runner, model):
    data, expected = batch(), results()
    x = runner.to_native(data["x"])
    options = {
        "positions": runner.native_lens(data["positions"]),
        "bias": runner.to_native(data["bias"]),
    }
    for index, weights, kwargs in attention_layers(FOLDERS / model):
        if runner.name.endswith("linen"):  # a Linen module holds no weights of its own
            layer = runner.make_layer(HIDDEN, kwargs.pop("num_heads"), **kwargs)
            layer = runner.set_weights(layer, weights)
        else:
            layer_class = importlib.import_module(runner.package).MultiHeadAttention
            layer = layer_class.from_canonical(weights, **kwargs)
            if runner.name.endswith("hybrid"):
                layer.hybridize()
        output = runner.to_numpy(runner.forward(layer, x, x, x, None, causal=True, **options))
        output = np.where(data["real"][..., None], output, 0.0)
        error = np.abs(output - expected[f"{model}.{index}.output"]).max()
        assert error <= FORWARD, f"{model} layer {index}: {error:.3g}"


def test_from_canonical_reads_the_layout_from_the_weights(runner):
    """Sizes, biases, grouped heads and sinks come from the weights; the numbers are the spec's."""
    if runner.name.endswith("linen"):
        pytest.skip("a Linen module is built by its runner")
    sizes = {"query_size": 6, "key_size": 5, "value_size": 4}
    weights = init_weights(8, **sizes, bias=True, num_heads=4, num_kv_heads=2, sinks=True)
    layer_class = importlib.import_module(runner.package).MultiHeadAttention
    layer = layer_class.from_canonical(weights, num_heads=4)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((2, 3, size)) for size in (6, 5, 4)]
    output = runner.forward(layer, *map(runner.to_native, inputs), None)
    expected, _ = spec.reference_forward(weights, *inputs, num_heads=4, sinks=True)
    np.testing.assert_allclose(runner.to_numpy(output), expected, rtol=0, atol=FORWARD)


def test_a_pruned_layer_is_made_from_its_weights_and_configuration(runner):
    """``from_canonical(pruned, **config.kwargs())``, as the heads guide prunes: the
    configuration's ``num_hiddens`` is the weights' (a TypeError, given twice, before)."""
    if runner.name.endswith("linen"):
        pytest.skip("a Linen module is built by its runner")
    weights = init_weights(8, num_heads=4, seed=3)
    pruned, config = prune_heads(weights, [1], num_heads=4)
    layer_class = importlib.import_module(runner.package).MultiHeadAttention
    layer = layer_class.from_canonical(pruned, **config.kwargs())
    inputs = [np.random.default_rng(3).standard_normal((2, 3, 8)) for _ in range(3)]
    output = runner.forward(layer, *map(runner.to_native, inputs), None)
    gates = np.array([1.0, 0.0, 1.0, 1.0])
    expected, _ = spec.reference_forward(weights, *inputs, num_heads=4, head_mask=gates)
    np.testing.assert_allclose(runner.to_numpy(output), expected, rtol=0, atol=FORWARD)
