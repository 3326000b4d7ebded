"""PyTorch: generating with a key/value cache, checked against one full causal forward."""

import numpy as np
import torch

from mha_multi.spec import reference_forward
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

num_hiddens, num_heads, num_kv_heads = 32, 4, 2  # grouped-query attention
weights = init_weights(num_hiddens, seed=0, num_heads=num_heads, num_kv_heads=num_kv_heads)
layer = MultiHeadAttention(num_hiddens, num_heads, num_kv_heads=num_kv_heads)
layer = set_weights(layer, weights).eval()

# Three sequences: prompts of 5, 2 and 3 tokens, then 4 generated tokens each.
prompt_lengths, steps = torch.tensor([5, 2, 3]), 4
generator = torch.Generator().manual_seed(0)
tokens = torch.randn(
    3, 5 + steps, num_hiddens, generator=generator
)  # example b: prompt, then steps

# [decode]
cache = layer.init_cache(batch_size=3, max_length=16)  # KVCache(keys, values, lengths)
with torch.no_grad():
    # Prefill: the prompts in one padded call; example b keeps prompt_lengths[b] positions.
    prompt = tokens[:, :5]
    out, cache = layer(prompt, prompt, prompt, prompt_lengths, causal=True, cache=cache)
    outputs = [out]
    # Decode: one new position per example and call, each at its own position.
    for step in range(steps):
        x = tokens[torch.arange(3), prompt_lengths + step].unsqueeze(1)  # (B, 1, num_hiddens)
        out, cache = layer(x, x, x, causal=True, cache=cache)
        outputs.append(out)
# [/decode]
print(cache.keys.shape, cache.lengths)  # torch.Size([3, 2, 16, 8]) tensor([9, 6, 7], ...)
assert cache.lengths.tolist() == (prompt_lengths + steps).tolist()

# One full causal forward over each example's whole sequence gives the same numbers.
lengths = prompt_lengths + steps
with torch.no_grad():
    full = layer(tokens, tokens, tokens, lengths, causal=True)
x = tokens.numpy()
expected, _ = reference_forward(weights, x, x, x, lengths.numpy(), num_heads=num_heads, causal=True)
for b in range(3):
    p = int(prompt_lengths[b])
    cached = torch.cat([outputs[0][b, :p]] + [o[b] for o in outputs[1:]])  # (p + steps, ·)
    np.testing.assert_allclose(cached.numpy(), full[b, : p + steps].numpy(), rtol=0, atol=5e-6)
    np.testing.assert_allclose(cached.numpy(), expected[b, : p + steps], rtol=0, atol=5e-6)
