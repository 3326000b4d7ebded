"""The spec's float64 reference on d2l's book example, checked by hand."""

import numpy as np

from mha_multi.spec import reference_forward
from mha_multi.weights import init_weights

num_hiddens, num_heads = 100, 5
batch, num_queries, num_kvpairs = 2, 4, 6
valid_lens = np.array([3, 2])

rng = np.random.default_rng(0)
queries = rng.standard_normal((batch, num_queries, num_hiddens))
keys = values = rng.standard_normal((batch, num_kvpairs, num_hiddens))
weights = init_weights(num_hiddens, seed=0)

output, attention = reference_forward(
    weights, queries, keys, values, valid_lens, num_heads=num_heads
)
print(output.shape, attention.shape)  # (2, 4, 100) (2, 5, 4, 6)
assert output.shape == (batch, num_queries, num_hiddens)
assert attention.shape == (batch, num_heads, num_queries, num_kvpairs)

# Example 0 sees keys 0..2, example 1 keys 0..1; every row sums to one.
assert np.all(attention[0, :, :, 3:] < 1e-300)
assert np.all(attention[1, :, :, 2:] < 1e-300)
np.testing.assert_allclose(attention.sum(-1), 1.0, rtol=0, atol=1e-15)

# Head 2 by hand: its columns of each projection, softmax over the visible keys.
head_dim = num_hiddens // num_heads
columns = slice(2 * head_dim, 3 * head_dim)
q = queries[0] @ weights["W_q"][:, columns]
k = keys[0, :3] @ weights["W_k"][:, columns]
scores = q @ k.T / np.sqrt(head_dim)
expected = np.exp(scores - scores.max(-1, keepdims=True))
expected /= expected.sum(-1, keepdims=True)
np.testing.assert_allclose(attention[0, 2, :, :3], expected, rtol=0, atol=1e-14)
