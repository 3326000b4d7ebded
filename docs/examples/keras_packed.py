"""Keras 3: packed sequences on any Keras backend."""

import keras
import numpy as np

from mha_multi import spec
from mha_multi.keras import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

weights = init_weights(16, num_heads=4, seed=0)
layer = MultiHeadAttention(num_hiddens=16, num_heads=4, rotary={"theta": 10000.0})
set_weights(layer, weights)

segment_ids = spec.segment_ids_from_lengths([[5, 2, 4], [7, 3]], length=11)
x = np.random.default_rng(0).standard_normal((2, 11, 16)).astype(np.float32)
output = layer(x, x, x, causal=True, segment_ids=keras.ops.convert_to_tensor(segment_ids))

expected, _ = spec.reference_forward(
    weights,
    x,
    x,
    x,
    num_heads=4,
    causal=True,
    rotary={"theta": 10000.0},
    segment_ids=segment_ids,
)
np.testing.assert_allclose(keras.ops.convert_to_numpy(output), expected, rtol=0, atol=5e-6)
