"""flax.nnx.MultiHeadAttention and mha_multi on the same weights."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_multi.jax import MultiHeadAttention, set_weights

num_hiddens, num_heads = 16, 2
native = nnx.MultiHeadAttention(
    num_heads, num_hiddens, use_bias=False, decode=False, rngs=nnx.Rngs(0)
)

rng = np.random.default_rng(0)
x = rng.standard_normal((2, 4, num_hiddens), dtype=np.float32)
valid_lens = np.array([3, 0])  # example 1: every key hidden
# Flax masks are True where a query may attend a key, shape (B, H|1, Q, K).
mask = (np.arange(4)[None, :] < valid_lens[:, None])[:, None, None, :]
mask = jnp.asarray(np.broadcast_to(mask, (2, 1, 4, 4)))
native_output = native(x, x, x, mask=mask)

# Flax keeps per-head kernels (in, H, dh) and (H, dh, out); merging the head
# axes gives the canonical (in, H*dh) layout: head h owns columns h*dh:(h+1)*dh.
weights = {
    "W_q": np.asarray(native.query.kernel[...]).reshape(num_hiddens, -1),
    "W_k": np.asarray(native.key.kernel[...]).reshape(num_hiddens, -1),
    "W_v": np.asarray(native.value.kernel[...]).reshape(num_hiddens, -1),
    "W_o": np.asarray(native.out.kernel[...]).reshape(-1, num_hiddens),
}
ours = set_weights(MultiHeadAttention(num_hiddens, num_heads, rngs=nnx.Rngs(0)), weights)
output = ours(x, x, x, valid_lens)

# Flax replaces hidden scores by the dtype's minimum, so a fully hidden row
# is uniform there too: the two layers agree on every row.
np.testing.assert_allclose(np.asarray(output), np.asarray(native_output), rtol=0, atol=5e-6)

# Causal masks differ when Q != K: nnx.make_causal_mask is top-left aligned
# (and built for self-attention); the spec's is bottom-right aligned.
_, weights_causal = ours(x[:, :2], x, x, causal=True, return_attention_weights=True)
visible = np.asarray(weights_causal[0, 0]) > 0
np.testing.assert_array_equal(visible, [[1, 1, 1, 0], [1, 1, 1, 1]])
