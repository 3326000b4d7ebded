"""Packed sequences: segment_ids from and to the other conventions, and the float64 spec."""

import numpy as np

from mha_multi import spec
from mha_multi.weights import init_weights

# Three sequences of 3, 2 and 4 tokens in one row of 10: the last position is padding.
segment_ids = spec.segment_ids_from_lengths([[3, 2, 4]], length=10)
print(segment_ids)  # [[ 0  0  0  1  1  2  2  2  2 -1]]

# FlashAttention's varlen layout: every sequence of every row, padding dropped.
cu_seqlens = spec.cu_seqlens_from_segment_ids(segment_ids)
assert cu_seqlens.tolist() == [0, 3, 5, 9]
np.testing.assert_array_equal(spec.segment_ids_from_cu_seqlens(cu_seqlens, length=10), segment_ids)

# transformers' packed batches (DataCollatorWithFlattening): restarting position ids.
position_ids = spec.restarting_positions(segment_ids)
assert position_ids[0, :9].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
np.testing.assert_array_equal(
    spec.segment_ids_from_position_ids(position_ids[:, :9]), segment_ids[:, :9]
)

# Ids must run contiguously: a sequence that comes back is refused, named.
try:
    spec.cu_seqlens_from_segment_ids([[0, 0, 1, 0]])
except ValueError as error:
    assert "contiguous" in str(error)

# The spec: each sequence of the packed row is what it is alone, causal, rotary.
weights = init_weights(8, num_heads=2, seed=0)
x = np.random.default_rng(0).standard_normal((1, 10, 8))
options = {"num_heads": 2, "causal": True, "rotary": {"theta": 10000.0}}
packed, _ = spec.reference_forward(weights, x, x, x, segment_ids=segment_ids, **options)
second = x[:, 3:5]
alone, _ = spec.reference_forward(weights, second, second, second, **options)
np.testing.assert_allclose(packed[:, 3:5], alone, rtol=0, atol=1e-12)
