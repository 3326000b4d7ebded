"""JAX / Flax: packed sequences in NNX, Linen and the pure function."""

import jax
import numpy as np
from flax import nnx

from mha_multi import spec
from mha_multi.jax import MultiHeadAttention, set_weights
from mha_multi.jax.functional import multi_head_attention
from mha_multi.jax.linen import MultiHeadAttention as LinenAttention
from mha_multi.jax.linen import variables_from_weights
from mha_multi.weights import init_weights

weights = init_weights(16, num_heads=4, seed=0)
segment_ids = spec.segment_ids_from_lengths([[5, 2, 4], [7, 3]], length=11)
x = np.random.default_rng(0).standard_normal((2, 11, 16)).astype(np.float32)
expected, _ = spec.reference_forward(
    weights, x, x, x, num_heads=4, causal=True, segment_ids=segment_ids
)

layer = set_weights(MultiHeadAttention(16, 4, rngs=nnx.Rngs(0)), weights)
layer.eval()
nnx_output = layer(x, x, x, causal=True, segment_ids=segment_ids)

module = LinenAttention(num_hiddens=16, num_heads=4)
linen_output = module.apply(
    variables_from_weights(weights, module), x, x, x, causal=True, segment_ids=segment_ids
)

# The pure function under jax.jit: the ids are an argument like any array.
packed = jax.jit(
    lambda x, ids: multi_head_attention(
        weights,
        x,
        x,
        x,
        num_heads=4,
        causal=True,
        segment_ids=ids,
        return_attention_weights=False,
    )[0]
)
for output in (nnx_output, linen_output, packed(x, segment_ids)):
    np.testing.assert_allclose(np.asarray(output), expected, rtol=0, atol=5e-6)
