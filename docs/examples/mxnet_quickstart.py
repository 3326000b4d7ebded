"""MXNet quick start: a Gluon HybridBlock on MXNet's numpy interface."""

import numpy as np
from mxnet import autograd
from mxnet import np as mnp

from mha_multi.mxnet import MultiHeadAttention, get_weights, set_weights
from mha_multi.spec import reference_forward
from mha_multi.weights import init_weights, load_weights, save_weights

num_hiddens, num_heads = 100, 5
# A canonical weights file, as written by any backend's get_weights.
save_weights("mha.safetensors", init_weights(num_hiddens, seed=0))

# [load]
weights = load_weights("mha.safetensors")
layer = MultiHeadAttention(num_hiddens=num_hiddens, num_heads=num_heads, dropout=0.1)
set_weights(layer, weights)  # creates the parameters: no initialize() needed
layer.hybridize()  # optional: one cached graph per call configuration
# [/load]

rng = np.random.default_rng(0)
queries = rng.standard_normal((2, 4, num_hiddens), dtype=np.float32)
keys = values = rng.standard_normal((2, 6, num_hiddens), dtype=np.float32)
valid_lens = np.array([3, 2], dtype=np.float32)  # float lengths, as d2l's MXNet code uses

output, attention = layer(
    mnp.array(queries),
    mnp.array(keys),
    mnp.array(values),
    mnp.array(valid_lens),
    return_attention_weights=True,
)
print(output.shape, attention.shape)  # (2, 4, 100) (2, 5, 4, 6)
assert output.shape == (2, 4, num_hiddens) and attention.shape == (2, num_heads, 4, 6)

expected_output, expected_attention = reference_forward(
    weights, queries, keys, values, valid_lens, num_heads=num_heads
)
np.testing.assert_allclose(output.asnumpy(), expected_output, rtol=0, atol=5e-6)
np.testing.assert_allclose(attention.asnumpy(), expected_attention, rtol=0, atol=5e-6)

# Training: dropout is active only inside autograd.record().
with autograd.record():
    loss = (layer(mnp.array(queries), mnp.array(keys), mnp.array(values)) ** 2).mean()
loss.backward()
assert layer.W_q.weight.grad().shape == (num_hiddens, num_hiddens)

for name, array in get_weights(layer).items():
    np.testing.assert_array_equal(array, weights[name])
