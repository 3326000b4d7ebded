"""Canonical weights: shapes, files (.npz and .safetensors), strict loading."""

import tempfile
from pathlib import Path

import numpy as np

from mha_multi.weights import check_weights, init_weights, load_weights, save_weights

weights = init_weights(12, query_size=7, key_size=5, value_size=3, bias=True, seed=0)
print({name: array.shape for name, array in weights.items()})
assert weights["W_q"].shape == (7, 12)  # (query_size, num_hiddens): y = x @ W + b
assert weights["W_k"].shape == (5, 12)
assert weights["W_v"].shape == (3, 12)
assert weights["W_o"].shape == (12, 12)
assert weights["b_o"].shape == (12,)

with tempfile.TemporaryDirectory() as directory:
    for name in ("mha.npz", "mha.safetensors"):
        path = Path(directory) / name
        save_weights(path, weights)
        loaded = load_weights(path)
        assert loaded.keys() == weights.keys()
        for key in weights:  # a round trip is bit-exact
            np.testing.assert_array_equal(loaded[key], weights[key])
            assert loaded[key].dtype == weights[key].dtype

# Loading is strict: a missing, extra or mis-shaped entry is named.
incomplete = {k: v for k, v in weights.items() if k != "b_v"}
try:
    check_weights(incomplete)
except ValueError as error:
    print(error)  # weights is missing 'b_v' (bias=True)
    assert "'b_v'" in str(error)
else:
    raise AssertionError("a missing entry must be rejected")

_, config = check_weights(weights)
print(config)
assert (config.num_hiddens, config.query_size, config.bias) == (12, 7, True)
