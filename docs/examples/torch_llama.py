"""A grouped-query checkpoint: transformers' Llama attention into mha_multi, and out to a file."""

import numpy as np
import torch
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaConfig

from mha_multi.interop.llama import from_llama
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import load_weights, save_weights

# [llama]
# A small Llama attention block with random weights: 8 query heads reading
# 2 key/value heads of size 8 (hidden_size 32), biases on.
config = LlamaConfig(
    hidden_size=32,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    attention_bias=True,
)
config._attn_implementation = "sdpa"
torch.manual_seed(0)
llama = LlamaAttention(config, layer_idx=0).eval()

weights, heads = from_llama(llama)  # canonical weights and the head layout
print(heads)  # {'num_heads': 8, 'num_kv_heads': 2, 'head_dim': 8}
layer = set_weights(MultiHeadAttention(32, bias=True, **heads), weights).eval()
# [/llama]

# Llama rotates queries and keys by position (rotary embeddings) inside its
# attention; with the rotation switched off (cos = 1, sin = 0) the two blocks
# compute the same function. Without a mask the Llama block is causal.
x = torch.randn(2, 5, 32)
cos, sin = torch.ones(2, 5, 8), torch.zeros(2, 5, 8)
with torch.no_grad():
    expected, _ = llama(x, position_embeddings=(cos, sin), attention_mask=None)
    output = layer(x, x, x, causal=True)
np.testing.assert_allclose(output.numpy(), expected.numpy(), rtol=0, atol=1e-5)

# [save]
save_weights("llama_attention.safetensors", weights)  # any backend loads this file
assert load_weights("llama_attention.safetensors").keys() == weights.keys()
# [/save]
