"""Keras 3 quick start: the same layer on the TensorFlow, JAX or PyTorch backend."""

import keras
import numpy as np

from mha_multi.keras import MultiHeadAttention, get_weights, set_weights
from mha_multi.spec import reference_forward
from mha_multi.weights import init_weights, load_weights, save_weights

num_hiddens, num_heads = 100, 5
# A canonical weights file, as written by any backend's get_weights.
save_weights("mha.safetensors", init_weights(num_hiddens, seed=0))

# [load]
weights = load_weights("mha.safetensors")
layer = MultiHeadAttention(num_hiddens=num_hiddens, num_heads=num_heads, dropout=0.1)
set_weights(layer, weights)  # also builds the layer: the sizes come from the weights
# [/load]

rng = np.random.default_rng(0)
queries = rng.standard_normal((2, 4, num_hiddens), dtype=np.float32)
keys = values = rng.standard_normal((2, 6, num_hiddens), dtype=np.float32)
valid_lens = np.array([3, 2])

# training defaults to False: no dropout.
output, attention = layer(queries, keys, values, valid_lens, return_attention_weights=True)
print(keras.backend.backend(), output.shape, attention.shape)
assert tuple(output.shape) == (2, 4, num_hiddens)
assert tuple(attention.shape) == (2, num_heads, 4, 6)

expected_output, expected_attention = reference_forward(
    weights, queries, keys, values, valid_lens, num_heads=num_heads
)
np.testing.assert_allclose(keras.ops.convert_to_numpy(output), expected_output, atol=5e-6, rtol=0)
np.testing.assert_allclose(
    keras.ops.convert_to_numpy(attention), expected_attention, atol=5e-6, rtol=0
)

# Dropout acts on the attention weights only with training=True.
dropped = layer(queries, keys, values, valid_lens, training=True)
assert not np.allclose(keras.ops.convert_to_numpy(dropped), expected_output, atol=1e-3)

# In a functional model, causal self-attention:
inputs = keras.Input((None, num_hiddens))
model = keras.Model(inputs, layer(inputs, inputs, inputs, causal=True))
x = rng.standard_normal((2, 5, num_hiddens), dtype=np.float32)
expected, _ = reference_forward(weights, x, x, x, num_heads=num_heads, causal=True)
np.testing.assert_allclose(keras.ops.convert_to_numpy(model(x)), expected, atol=5e-6, rtol=0)

for name, array in get_weights(layer).items():
    np.testing.assert_array_equal(array, weights[name])
