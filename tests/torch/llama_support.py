"""transformers' Llama attention, built small from its own config (random weights, no download)."""

from __future__ import annotations

import numpy as np
import torch


def llama_attention(num_heads, num_kv_heads, head_dim, *, bias, hidden_size=16, seed=0):
    """transformers' ``LlamaAttention`` from a small config, random weights, float64."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        attention_bias=bias,
    )
    # SDPA: the eager implementation takes its softmax in float32 whatever the dtype.
    config._attn_implementation = "sdpa"
    module = LlamaAttention(config, layer_idx=0).double().eval()
    if bias:  # transformers starts biases at zero: make them count
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(module, name).bias.normal_()
    return module


def llama_output(module, x, *, causal) -> np.ndarray:
    """The module's output with rotary embeddings turned off (cos = 1, sin = 0).

    Without a mask the module is causal unless told otherwise (``is_causal``).
    """
    batch, length, _ = x.shape
    cos = torch.ones(batch, length, module.head_dim, dtype=x.dtype)
    module.is_causal = causal
    with torch.no_grad():
        output, _ = module(x, position_embeddings=(cos, torch.zeros_like(cos)), attention_mask=None)
    return output.numpy()
