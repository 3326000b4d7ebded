"""Flax NNX quick start: weights from a file, checked against the float64 reference."""

import jax
import numpy as np
from flax import nnx

from mha_multi.jax import MultiHeadAttention, get_weights, set_weights
from mha_multi.spec import reference_forward
from mha_multi.weights import init_weights, load_weights, save_weights

num_hiddens, num_heads = 100, 5
# A canonical weights file, as written by any backend's get_weights.
save_weights("mha.safetensors", init_weights(num_hiddens, seed=0))

# [load]
weights = load_weights("mha.safetensors")
layer = MultiHeadAttention(
    num_hiddens=num_hiddens, num_heads=num_heads, dropout=0.1, rngs=nnx.Rngs(0)
)
set_weights(layer, weights)
layer.eval()  # dropout off
# [/load]

rng = np.random.default_rng(0)
queries = rng.standard_normal((2, 4, num_hiddens), dtype=np.float32)
keys = values = rng.standard_normal((2, 6, num_hiddens), dtype=np.float32)
valid_lens = np.array([3, 2])

output, attention = layer(queries, keys, values, valid_lens, return_attention_weights=True)
print(output.shape, attention.shape)  # (2, 4, 100) (2, 5, 4, 6)
assert output.shape == (2, 4, num_hiddens) and attention.shape == (2, num_heads, 4, 6)

expected_output, expected_attention = reference_forward(
    weights, queries, keys, values, valid_lens, num_heads=num_heads
)
np.testing.assert_allclose(np.asarray(output), expected_output, rtol=0, atol=5e-6)
np.testing.assert_allclose(np.asarray(attention), expected_attention, rtol=0, atol=5e-6)


# Under jit, and with gradients: the layer is an ordinary NNX module.
@nnx.jit
def loss(layer, queries, keys, values, valid_lens):
    return (layer(queries, keys, values, valid_lens, causal=True) ** 2).mean()


grads = nnx.grad(loss)(layer, queries, keys, values, valid_lens)
assert grads["W_q"]["kernel"][...].shape == (num_hiddens, num_hiddens)

# Dropout on the attention weights in train mode, from the layer's rng stream.
layer.train()
first, second = (layer(queries, keys, values, valid_lens) for _ in range(2))
assert not np.allclose(np.asarray(first), np.asarray(second))
layer.eval()

for name, array in get_weights(layer).items():
    np.testing.assert_array_equal(array, weights[name])
assert isinstance(output, jax.Array)
