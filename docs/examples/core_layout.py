"""transpose_qkv / transpose_output: the head layout of every backend."""

import numpy as np

from mha_multi.spec import NumpyOps, transpose_output, transpose_qkv

ops = NumpyOps()
batch, length, num_heads, head_dim = 2, 3, 4, 5
x = np.arange(batch * length * num_heads * head_dim, dtype=np.float64).reshape(
    batch, length, num_heads * head_dim
)

heads = transpose_qkv(ops, x, num_heads)
assert heads.shape == (batch * num_heads, length, head_dim)

# Flat row b*H + h holds columns [h*dh, (h+1)*dh) of example b.
for b in range(batch):
    for h in range(num_heads):
        np.testing.assert_array_equal(
            heads[b * num_heads + h], x[b, :, h * head_dim : (h + 1) * head_dim]
        )

# transpose_output is the exact inverse.
np.testing.assert_array_equal(transpose_output(ops, heads, num_heads), x)
