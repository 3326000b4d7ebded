"""keras.layers.MultiHeadAttention and mha_multi on the same weights."""

import keras
import numpy as np

from mha_multi.keras import MultiHeadAttention, set_weights

num_hiddens, num_heads = 16, 2
head_dim = num_hiddens // num_heads
native = keras.layers.MultiHeadAttention(num_heads, key_dim=head_dim, use_bias=False)

rng = np.random.default_rng(0)
x = rng.standard_normal((2, 4, num_hiddens), dtype=np.float32)
valid_lens = np.array([3, 0])  # example 1: every key hidden
# Keras' attention_mask is True where a query may attend a key (B, Q, K).
mask = np.arange(4)[None, None, :] < valid_lens[:, None, None]
mask = np.broadcast_to(mask, (2, 4, 4))

# Keras' call order is (query, value, key); ours is (queries, keys, values).
native_output, native_scores = native(x, x, x, attention_mask=mask, return_attention_scores=True)

# Keras keeps per-head kernels (in, H, dh) and (H, dh, out); merging the head
# axes gives the canonical (in, H*dh) layout: head h owns columns h*dh:(h+1)*dh.
weights = {
    "W_q": keras.ops.convert_to_numpy(native.query_dense.kernel).reshape(num_hiddens, -1),
    "W_k": keras.ops.convert_to_numpy(native.key_dense.kernel).reshape(num_hiddens, -1),
    "W_v": keras.ops.convert_to_numpy(native.value_dense.kernel).reshape(num_hiddens, -1),
    "W_o": keras.ops.convert_to_numpy(native.output_dense.kernel).reshape(-1, num_hiddens),
}
ours = set_weights(MultiHeadAttention(num_hiddens, num_heads), weights)
output, attention = ours(x, x, x, valid_lens, return_attention_weights=True)
output, attention = (keras.ops.convert_to_numpy(t) for t in (output, attention))
native_output, native_scores = (
    keras.ops.convert_to_numpy(t) for t in (native_output, native_scores)
)

# Where a query sees some key, the two layers agree; both weights are per head.
np.testing.assert_allclose(output[0], native_output[0], rtol=0, atol=5e-6)
np.testing.assert_allclose(attention[0], native_scores[0], rtol=0, atol=5e-6)
# A query that sees no key: Keras' masked softmax gives zero weights (output
# 0); the spec gives uniform weights 1/K (output: the mean of all values).
np.testing.assert_allclose(native_scores[1], 0.0, rtol=0, atol=0)
np.testing.assert_allclose(attention[1], 0.25, rtol=0, atol=1e-7)
