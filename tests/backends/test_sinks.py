"""Every backend's layer with attention sinks: its weight, its heads, a Keras file.

The numbers of the sink's softmax, its gradient and the cache are the parity
cases' (``sinks``, ``cached_sinks``); here, what goes with the option: the
canonical entry in and out (strictly), a fully hidden row's zero context, and
pruning heads against gating them, each against the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_multi import spec
from mha_multi.heads import prune_heads
from mha_multi.parity.compare import TOLERANCES
from mha_multi.weights import init_weights

FORWARD, _ = TOLERANCES["float32"]
HEADS = {"num_kv_heads": 2, "head_dim": 4}


def sink_weights():
    weights = init_weights(16, num_heads=4, **HEADS, bias=True, sinks=True, seed=5)
    weights["sinks"] = np.array([1.5, -0.5, 0.0, 3.0], np.float32)
    return weights


def inputs():
    rng = np.random.default_rng(6)
    return [rng.standard_normal((2, 5, 16)).astype(np.float32) for _ in range(3)]


def test_the_weight_goes_in_and_out_strictly(runner):
    weights = sink_weights()
    layer = runner.set_weights(runner.make_layer(16, 4, bias=True, sinks=True, **HEADS), weights)
    got = runner.get_weights(layer)
    assert sorted(got) == sorted(weights)
    assert got["sinks"].tobytes() == weights["sinks"].tobytes()
    without = {name: value for name, value in weights.items() if name != "sinks"}
    with pytest.raises(ValueError, match="'sinks'"):
        runner.set_weights(runner.make_layer(16, 4, bias=True, sinks=True, **HEADS), without)
    with pytest.raises(ValueError, match="'sinks'"):
        runner.set_weights(runner.make_layer(16, 4, bias=True, **HEADS), weights)


def test_rows_that_see_no_key_give_the_output_bias(runner):
    weights = sink_weights()
    layer = runner.set_weights(runner.make_layer(16, 4, bias=True, sinks=True, **HEADS), weights)
    lens = np.array([[0, 2, 0, 5, 1], [5, 0, 3, 3, 0]], np.int32)
    native = [runner.to_native(x) for x in inputs()]
    output = runner.to_numpy(runner.forward(layer, *native, runner.native_lens(lens)))
    expected, _ = spec.reference_forward(weights, *inputs(), lens, num_heads=4, sinks=True)
    np.testing.assert_allclose(output, expected, rtol=0, atol=FORWARD)
    hidden = lens == 0
    np.testing.assert_allclose(output[hidden], np.broadcast_to(weights["b_o"], (4, 16)), atol=1e-6)


def test_a_pruned_layer_is_the_gated_one(runner):
    weights = sink_weights()
    pruned, config = prune_heads(weights, [2, 3], num_heads=4, num_kv_heads=2)
    kwargs = config.kwargs()
    layer = runner.make_layer(kwargs.pop("num_hiddens"), kwargs.pop("num_heads"), **kwargs)
    small = runner.set_weights(layer, pruned)
    native = [runner.to_native(x) for x in inputs()]
    lens = np.array([3, 5], np.int32)
    output = runner.forward(small, *native, runner.native_lens(lens), causal=True)
    gates = np.array([1.0, 1.0, 0.0, 0.0])
    expected, _ = spec.reference_forward(
        weights, *inputs(), lens, num_heads=4, causal=True, head_mask=gates, sinks=True
    )
    np.testing.assert_allclose(runner.to_numpy(output), expected, rtol=0, atol=FORWARD)
