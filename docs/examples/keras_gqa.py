"""keras.layers.GroupQueryAttention's weights in mha_multi's Keras layer: the same output."""

import keras
import numpy as np

from mha_multi import spec
from mha_multi.interop.keras import attention_mask, from_keras_gqa, to_keras_gqa
from mha_multi.keras import MultiHeadAttention, set_weights

# [gqa]
# 8 query heads reading 2 key/value heads of size 4; the output has the
# query's 16 features (Keras' layer projects back to the query size).
native = keras.layers.GroupQueryAttention(
    head_dim=4, num_query_heads=8, num_key_value_heads=2, bias_initializer="random_normal"
)
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 5, 16), dtype=np.float32)
native(x, x)  # builds its projections

weights, heads = from_keras_gqa(native)  # canonical weights and the head layout
print(heads)  # {'num_heads': 8, 'num_kv_heads': 2, 'head_dim': 4}
layer = set_weights(MultiHeadAttention(16, **heads, bias=True), weights)
# [/gqa]
assert heads == {"num_heads": 8, "num_kv_heads": 2, "head_dim": 4}
# Keys and values are projected to num_kv_heads * head_dim = 8 features.
assert weights["W_q"].shape == (16, 32) and weights["W_k"].shape == (16, 8)
assert weights["W_o"].shape == (32, 16) and weights["b_v"].shape == (8,)

# [mask]
valid_lens = np.array([5, 3])
# Keras' attention_mask is (B, Q, K), True where a query may attend a key;
# its call order is (query, value, key), ours (queries, keys, values).
mask = attention_mask(valid_lens, 5, 5)
native_output = keras.ops.convert_to_numpy(native(x, x, x, attention_mask=mask))
output = keras.ops.convert_to_numpy(layer(x, x, x, valid_lens))
# [/mask]
np.testing.assert_allclose(output, native_output, rtol=0, atol=5e-6)
# Both are the spec's grouped-query attention: query head h reads key/value
# head h // 4 (float64 reference).
expected, _ = spec.reference_forward(weights, x, x, x, valid_lens, num_heads=8)
np.testing.assert_allclose(output, expected, rtol=0, atol=5e-6)
np.testing.assert_allclose(native_output, expected, rtol=0, atol=5e-6)

# And back: our weights in a new GroupQueryAttention, the same numbers again.
again = to_keras_gqa(weights, num_heads=8)
assert (again.num_key_value_heads, again.head_dim) == (2, 4)
again_output = keras.ops.convert_to_numpy(again(x, x, x, attention_mask=mask))
np.testing.assert_allclose(again_output, native_output, rtol=0, atol=0)
