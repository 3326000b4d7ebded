"""Visibility from valid_lens and causal; fully hidden rows are uniform."""

import numpy as np

from mha_multi.spec import MASK_VALUE, NumpyOps, masked_softmax, visibility

ops = NumpyOps()
batch, num_heads, num_queries, num_keys = 2, 1, 4, 6
scores = np.random.default_rng(0).standard_normal((batch, num_heads, num_queries, num_keys))
query, key = np.indices((num_queries, num_keys))

# 1-D lengths: key j is visible to every query of example b iff j < valid_lens[b].
visible = visibility(ops, num_queries, num_keys, np.array([3, 0]))
assert visible.shape == (batch, 1, 1, num_keys)
np.testing.assert_array_equal(visible[0, 0, 0], key[0] < 3)

# Float lengths follow the same comparison: 2.5 shows keys 0, 1 and 2.
np.testing.assert_array_equal(
    visibility(ops, num_queries, num_keys, np.array([2.5, 6.0]))[0, 0, 0], key[0] < 2.5
)

# 2-D lengths: one length per query.
lens_2d = np.array([[1, 4, 0, 6], [6, 6, 6, 6]])
visible_2d = visibility(ops, num_queries, num_keys, lens_2d)
assert visible_2d.shape == (batch, 1, num_queries, num_keys)
np.testing.assert_array_equal(visible_2d[0, 0], key < lens_2d[0][:, None])

# causal: bottom-right aligned, j <= i + (K - Q); AND-ed with the lengths.
causal = visibility(ops, num_queries, num_keys, None, causal=True)
np.testing.assert_array_equal(causal, key <= query + (num_keys - num_queries))
both = visibility(ops, num_queries, num_keys, np.array([3, 0]), causal=True)
np.testing.assert_array_equal(both[0, 0], (key < 3) & (key <= query + 2))

# Hidden scores are *replaced* by -1e6: a row with no visible key is uniform.
weights = masked_softmax(ops, scores, visible)
np.testing.assert_allclose(weights[1], 1.0 / num_keys, rtol=0, atol=1e-15)
assert MASK_VALUE == -1e6
