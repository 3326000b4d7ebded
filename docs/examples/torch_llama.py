"""A grouped-query checkpoint: transformers' Llama attention into mha_multi, and out to a file."""

import numpy as np
import torch
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaRotaryEmbedding,
)

from mha_multi.interop.llama import from_llama
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import load_weights, save_weights

# [llama]
# A small Llama 3 attention block with random weights: 8 query heads reading
# 2 key/value heads of size 8 (hidden_size 32), biases on, Llama 3's
# frequency scaling of its rotary embedding.
config = LlamaConfig(
    hidden_size=32,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    attention_bias=True,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)
config._attn_implementation = "sdpa"
torch.manual_seed(0)
llama = LlamaAttention(config, layer_idx=0).eval()
rotary_embedding = LlamaRotaryEmbedding(config)

weights, kwargs = from_llama(llama)  # canonical weights and the block's settings
print(sorted(kwargs))  # ['bias', 'head_dim', 'num_heads', 'num_kv_heads', 'rotary']
layer = set_weights(MultiHeadAttention(32, **kwargs), weights).eval()

# The block and the layer on the same inputs and positions: the layer
# rotates its projected queries and keys by `positions` itself.
x = torch.randn(2, 5, 32)
position_ids = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
with torch.no_grad():
    expected, _ = llama(x, rotary_embedding(x, position_ids), attention_mask=None)
    output = layer(x, x, x, causal=True, positions=position_ids)
np.testing.assert_allclose(output.numpy(), expected.numpy(), rtol=0, atol=1e-5)
# [/llama]

# [save]
save_weights("llama_attention.safetensors", weights)  # any backend loads this file
assert load_weights("llama_attention.safetensors").keys() == weights.keys()
# [/save]
