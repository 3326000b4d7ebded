"""Keras 3: generating with a key/value cache, checked against one full causal forward."""

import keras
import numpy as np

from mha_multi.keras import MultiHeadAttention, set_weights
from mha_multi.spec import reference_forward
from mha_multi.weights import init_weights

num_hiddens, num_heads, num_kv_heads = 32, 4, 2  # grouped-query attention
weights = init_weights(num_hiddens, seed=0, num_heads=num_heads, num_kv_heads=num_kv_heads)
layer = set_weights(MultiHeadAttention(num_hiddens, num_heads, num_kv_heads=num_kv_heads), weights)

# Three sequences: prompts of 5, 2 and 3 tokens, then 4 generated tokens each.
prompt_lengths, steps = np.array([5, 2, 3]), 4
rng = np.random.default_rng(0)
tokens = rng.standard_normal((3, 5 + steps, num_hiddens), dtype=np.float32)
# Example b's sequence: its prompt, then its steps tokens.
sequences = [np.concatenate([tokens[b, :p], tokens[b, 5:]]) for b, p in enumerate(prompt_lengths)]

# [decode]
cache = layer.init_cache(batch_size=3, max_length=16)  # KVCache(keys, values, lengths)
# Prefill: the prompts in one padded call; example b keeps prompt_lengths[b] positions.
prompt = tokens[:, :5]
out, cache = layer(prompt, prompt, prompt, prompt_lengths, causal=True, cache=cache)
outputs = [keras.ops.convert_to_numpy(out)]
# Decode: one new position per example and call, each at its own position.
for step in range(steps):
    x = tokens[:, 5 + step : 6 + step]  # (B, 1, num_hiddens)
    out, cache = layer(x, x, x, causal=True, cache=cache)
    outputs.append(keras.ops.convert_to_numpy(out))
# [/decode]
lengths = keras.ops.convert_to_numpy(cache.lengths)
print(keras.backend.backend(), tuple(cache.keys.shape), lengths)  # (3, 2, 16, 8) [9 6 7]
assert lengths.tolist() == (prompt_lengths + steps).tolist()

# One full causal forward over each example's whole sequence gives the same numbers.
padded = np.zeros_like(tokens)
for b, sequence in enumerate(sequences):
    padded[b, : len(sequence)] = sequence
full = keras.ops.convert_to_numpy(layer(padded, padded, padded, lengths, causal=True))
expected, _ = reference_forward(
    weights, padded, padded, padded, lengths, num_heads=num_heads, causal=True
)
for b, p in enumerate(prompt_lengths):
    cached = np.concatenate([outputs[0][b, :p]] + [o[b] for o in outputs[1:]])  # (p + steps, ·)
    np.testing.assert_allclose(cached, full[b, : p + steps], rtol=0, atol=5e-6)
    np.testing.assert_allclose(cached, expected[b, : p + steps], rtol=0, atol=5e-6)
