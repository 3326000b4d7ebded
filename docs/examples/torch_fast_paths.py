"""Which path a torch call takes, and why both give the spec's numbers."""

from unittest import mock

import numpy as np
import torch

from mha_multi.spec import reference_forward
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

weights = init_weights(16, seed=1)
layer = set_weights(MultiHeadAttention(16, num_heads=4, dropout=0.5), weights).eval()
generator = torch.Generator().manual_seed(0)
queries = torch.randn(3, 5, 16, generator=generator)
keys = values = torch.randn(3, 7, 16, generator=generator)
valid_lens = torch.tensor([4, 0, 7])  # example 1 sees no key at all

sdpa = torch.nn.functional.scaled_dot_product_attention
with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", wraps=sdpa) as fused:
    fast = layer(queries, keys, values, valid_lens)  # the default call: fused
    assert fused.call_count == 1
    generic, attention = layer(queries, keys, values, valid_lens, return_attention_weights=True)
    assert fused.call_count == 1  # weights requested: the generic (spec) path

# Both paths agree with the float64 reference, fully hidden rows included:
# example 1's rows have uniform weights, so its output is the mean of all values.
args = [x.numpy() for x in (queries, keys, values, valid_lens)]
expected, _ = reference_forward(weights, *args, num_heads=4)
for output in (fast, generic):
    np.testing.assert_allclose(output.detach().numpy(), expected, rtol=0, atol=5e-6)
np.testing.assert_allclose(attention[1].detach().numpy(), 1 / 7, rtol=0, atol=1e-7)
mean_value = values[1].mean(0) @ layer.W_v.weight.T @ layer.W_o.weight.T
np.testing.assert_allclose(
    fast[1].detach().numpy(), mean_value.expand(5, 16).detach().numpy(), rtol=0, atol=5e-6
)

# Dropout acts only in train() mode; eval() calls are deterministic.
layer.train()
torch.manual_seed(0)
assert not torch.allclose(layer(queries, keys, values), layer(queries, keys, values))
layer.eval()
assert torch.equal(layer(queries, keys, values), layer(queries, keys, values))
