"""Flax: generating with a key/value cache, called as it is and under jit, checked against
one full causal forward."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_multi.jax import MultiHeadAttention, linen, set_weights
from mha_multi.spec import reference_forward
from mha_multi.weights import init_weights

num_hiddens, num_heads, num_kv_heads = 32, 4, 2  # grouped-query attention
weights = init_weights(num_hiddens, seed=0, num_heads=num_heads, num_kv_heads=num_kv_heads)
layer = MultiHeadAttention(num_hiddens, num_heads, num_kv_heads=num_kv_heads, rngs=nnx.Rngs(0))
set_weights(layer, weights).eval()

# Three sequences: prompts of 5, 2 and 3 tokens, then 4 more tokens each.
prompt_lengths, steps = np.array([5, 2, 3]), 4
rng = np.random.default_rng(0)
tokens = rng.standard_normal((3, 5 + steps, num_hiddens), dtype=np.float32)
# Example b's sequence: tokens[b, :prompt_lengths[b] + steps].


# [decode]
cache = layer.init_cache(batch_size=3, max_length=16)  # KVCache(keys, values, lengths)
# Called as it is, each call runs one program compiled per signature (the layer's
# call plan: the prefill's, then every step's), and checks the lengths it is given.
# Prefill: the prompts in one padded call; example b keeps prompt_lengths[b] positions.
prompts = jnp.asarray(tokens[:, :5])
out, cache = layer(prompts, prompts, prompts, jnp.asarray(prompt_lengths), causal=True, cache=cache)
outputs = [out]
for step in range(steps):
    # One new position per example, each at its own place: prompt_lengths[b] + step.
    x = jnp.asarray(tokens[np.arange(3), prompt_lengths + step][:, None])  # (B, 1, num_hiddens)
    out, cache = layer(x, x, x, causal=True, cache=cache)
    outputs.append(out)
# [/decode]
print(cache.keys.shape, cache.lengths)  # (3, 2, 16, 8) [9 6 7]
assert cache.lengths.tolist() == (prompt_lengths + steps).tolist()


# Compiled (a model's jitted step, say) the same generation, to float32 rounding,
# as Flax's guide writes a fast loop: the layer split once, and jax.jit of a
# function that merges it (nnx.jit would walk the layer's graph of modules and
# variables at every call). Compiled code cannot raise on values: a step past
# max_length would drop what does not fit, never overwrite a kept position, and
# leave lengths > max_length.
graphdef, state = nnx.split(layer)


@jax.jit  # compiled once for the prefill's length, once for the steps' length 1
def attend(state, x, new_lens, cache):
    return nnx.merge(graphdef, state)(x, x, x, new_lens, causal=True, cache=cache)


cache = layer.init_cache(batch_size=3, max_length=16)
out, cache = attend(state, prompts, jnp.asarray(prompt_lengths), cache)
jitted_outputs = [out]
for step in range(steps):
    x = jnp.asarray(tokens[np.arange(3), prompt_lengths + step][:, None])
    out, cache = attend(state, x, None, cache)
    jitted_outputs.append(out)

# One full causal forward over each example's whole sequence gives the same numbers.
lengths = prompt_lengths + steps
full = layer(tokens, tokens, tokens, lengths, causal=True)
expected, _ = reference_forward(
    weights, tokens, tokens, tokens, lengths, num_heads=num_heads, causal=True
)


def cached_rows(outputs, b):
    """Example b's outputs at its real positions: its prompt, then one per step."""
    prompt = np.asarray(outputs[0][b, : prompt_lengths[b]])
    return np.concatenate([prompt, *(np.asarray(o[b]) for o in outputs[1:])])


for b in range(3):
    cached = cached_rows(outputs, b)
    np.testing.assert_allclose(cached, np.asarray(full[b, : lengths[b]]), rtol=0, atol=5e-6)
    np.testing.assert_allclose(cached, expected[b, : lengths[b]], rtol=0, atol=5e-6)
    jitted = cached_rows(jitted_outputs, b)
    np.testing.assert_allclose(jitted, expected[b, : lengths[b]], rtol=0, atol=5e-6)

# Flax Linen: init_cache needs no variables; the cache goes in and out of apply.
module = linen.MultiHeadAttention(num_hiddens, num_heads, num_kv_heads=num_kv_heads)
variables = linen.variables_from_weights(weights, module)


@jax.jit
def linen_attend(variables, x, new_lens, cache):
    return module.apply(variables, x, x, x, new_lens, causal=True, cache=cache)


cache = module.init_cache(batch_size=3, max_length=16)
out, cache = linen_attend(variables, jnp.asarray(tokens[:, :5]), prompt_lengths, cache)
linen_outputs = [out]
for step in range(steps):
    x = jnp.asarray(tokens[np.arange(3), prompt_lengths + step][:, None])
    out, cache = linen_attend(variables, x, None, cache)
    linen_outputs.append(out)
for b in range(3):
    np.testing.assert_allclose(cached_rows(linen_outputs, b), expected[b, : lengths[b]], atol=5e-6)
