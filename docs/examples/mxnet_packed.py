"""MXNet: packed sequences, imperative or hybridized."""

import numpy as np
from mxnet import np as mnp

from mha_multi import spec
from mha_multi.mxnet import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

weights = init_weights(16, num_heads=4, seed=0)
layer = set_weights(MultiHeadAttention(num_hiddens=16, num_heads=4), weights)
layer.hybridize()  # a call with segment_ids runs on the parameters' arrays

segment_ids = spec.segment_ids_from_lengths([[5, 2, 4], [7, 3]], length=11)
x = np.random.default_rng(0).standard_normal((2, 11, 16)).astype(np.float32)
output = layer(
    mnp.array(x),
    mnp.array(x),
    mnp.array(x),
    causal=True,
    segment_ids=mnp.array(segment_ids, dtype=np.int32),
)

expected, _ = spec.reference_forward(
    weights, x, x, x, num_heads=4, causal=True, segment_ids=segment_ids
)
np.testing.assert_allclose(output.asnumpy(), expected, rtol=0, atol=5e-6)
