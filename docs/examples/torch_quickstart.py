"""PyTorch quick start: d2l's book example, checked against the float64 reference."""

import numpy as np
import torch

from mha_multi.spec import reference_forward
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights
from mha_multi.weights import init_weights, load_weights, save_weights

num_hiddens, num_heads = 100, 5
layer = MultiHeadAttention(num_hiddens=num_hiddens, num_heads=num_heads, dropout=0.1)
weights = init_weights(num_hiddens, seed=0)  # canonical weights, any source
set_weights(layer, weights)
layer.eval()  # dropout off

generator = torch.Generator().manual_seed(0)
queries = torch.randn(2, 4, num_hiddens, generator=generator)
keys = values = torch.randn(2, 6, num_hiddens, generator=generator)
valid_lens = torch.tensor([3, 2])

output = layer(queries, keys, values, valid_lens)  # (B, Q, num_hiddens)
output, attention = layer(queries, keys, values, valid_lens, return_attention_weights=True)
print(output.shape, attention.shape)  # torch.Size([2, 4, 100]) torch.Size([2, 5, 4, 6])
assert output.shape == (2, 4, num_hiddens) and attention.shape == (2, num_heads, 4, 6)

# The same numbers as the spec evaluated in float64 (float32 tolerance 5e-6).
args = [x.numpy() for x in (queries, keys, values, valid_lens)]
expected_output, expected_attention = reference_forward(weights, *args, num_heads=num_heads)
np.testing.assert_allclose(output.detach().numpy(), expected_output, rtol=0, atol=5e-6)
np.testing.assert_allclose(attention.detach().numpy(), expected_attention, rtol=0, atol=5e-6)

# Causal self-attention, with per-query lengths as well.
x = torch.randn(2, 5, num_hiddens, generator=generator)
lens_2d = torch.tensor([[5, 5, 2, 5, 5], [1, 2, 3, 4, 5]])
causal_output = layer(x, x, x, lens_2d, causal=True)
expected, _ = reference_forward(
    weights, x.numpy(), x.numpy(), x.numpy(), lens_2d.numpy(), num_heads=num_heads, causal=True
)
np.testing.assert_allclose(causal_output.detach().numpy(), expected, rtol=0, atol=5e-6)

# Training: gradients flow as usual; dropout acts on the attention weights.
layer.train()
layer(queries, keys, values, valid_lens).sum().backward()
assert layer.W_q.weight.grad is not None

# get_weights returns the canonical mapping, bit for bit.
for name, array in get_weights(layer).items():
    np.testing.assert_array_equal(array, weights[name])

# [save]
save_weights("mha.safetensors", get_weights(layer))  # loads into any backend
# [/save]
for name, array in load_weights("mha.safetensors").items():
    np.testing.assert_array_equal(array, weights[name])
