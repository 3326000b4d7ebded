"""MXNet: incremental decoding with a key/value cache (a ragged batch, hybridized)."""

import numpy as np
from mxnet import np as mnp

from mha_multi.mxnet import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

num_hiddens, num_heads, num_kv_heads = 32, 8, 2
layer = MultiHeadAttention(num_hiddens, num_heads, num_kv_heads=num_kv_heads)
set_weights(layer, init_weights(num_hiddens, num_heads=num_heads, num_kv_heads=num_kv_heads))
layer.hybridize()  # attention in compiled graphs; the cache is written in place

rng = np.random.default_rng(0)
prompt_lengths = np.array([4, 2, 3])
steps = 3  # positions decoded after each prompt
x = rng.standard_normal((3, 4 + steps, num_hiddens), dtype=np.float32)
lengths = prompt_lengths + steps  # each sequence's real positions

# [decode]
cache = layer.init_cache(batch_size=3, max_length=8)  # lengths all 0
# Prefill: the prompts in one padded call; example b keeps prompt_lengths[b] positions.
prompts = mnp.array(x[:, :4])
output, cache = layer(
    prompts, prompts, prompts, mnp.array(prompt_lengths), causal=True, cache=cache
)
outputs = [output[b, :n] for b, n in enumerate(prompt_lengths)]
for step in range(steps):
    # One new position per example, each at its own place: prompt_lengths[b] + step.
    new = mnp.array(x[np.arange(3), prompt_lengths + step][:, None])  # (B, 1, num_hiddens)
    output, cache = layer(new, new, new, causal=True, cache=cache)
    outputs = [mnp.concatenate([o, output[b]]) for b, o in enumerate(outputs)]
print(cache.lengths)  # [7 5 6]
# [/decode]

assert cache.lengths.tolist() == lengths.tolist()
assert cache.keys.shape == (3, num_kv_heads, 8, num_hiddens // num_heads)

# The same as one causal forward over the whole sequences: sequence b is x[b, :lengths[b]].
full = layer(mnp.array(x), mnp.array(x), mnp.array(x), mnp.array(lengths), causal=True)
for b, n in enumerate(lengths):
    np.testing.assert_allclose(outputs[b].asnumpy(), full[b, :n].asnumpy(), rtol=0, atol=5e-6)
