"""Flax Linen: canonical weights as variables, dropout through the 'dropout' rng."""

import jax
import numpy as np

from mha_multi.jax.linen import MultiHeadAttention, variables_from_weights, weights_from_variables
from mha_multi.spec import reference_forward
from mha_multi.weights import init_weights

num_hiddens, num_heads = 100, 5
module = MultiHeadAttention(num_hiddens=num_hiddens, num_heads=num_heads, dropout=0.1)

rng = np.random.default_rng(0)
queries = rng.standard_normal((2, 4, num_hiddens), dtype=np.float32)
keys = values = rng.standard_normal((2, 6, num_hiddens), dtype=np.float32)
valid_lens = np.array([3, 2])

weights = init_weights(num_hiddens, seed=0)
variables = variables_from_weights(weights, module)  # {'params': {'W_q': {'kernel': ...}}}
output, attention = module.apply(
    variables, queries, keys, values, valid_lens, return_attention_weights=True
)
assert output.shape == (2, 4, num_hiddens) and attention.shape == (2, num_heads, 4, 6)
expected, _ = reference_forward(weights, queries, keys, values, valid_lens, num_heads=num_heads)
np.testing.assert_allclose(np.asarray(output), expected, rtol=0, atol=5e-6)

# Training mode: dropout draws from the 'dropout' rng.
dropped = module.apply(
    variables,
    queries,
    keys,
    values,
    valid_lens,
    training=True,
    rngs={"dropout": jax.random.key(1)},
)
assert not np.allclose(np.asarray(dropped), np.asarray(output))

# Fresh parameters from init; their canonical weights load in any backend.
initialized = module.init(jax.random.key(0), queries, keys, values, valid_lens)
fresh = weights_from_variables(initialized)
assert fresh["W_q"].shape == (num_hiddens, num_hiddens)
for name, array in weights_from_variables(variables).items():
    np.testing.assert_array_equal(array, weights[name])
