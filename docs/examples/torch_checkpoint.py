"""A transformers checkpoint into PyTorch: Phi-3's attention from .safetensors and config.json."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from mha_multi.interop.llama import load_llama, rotary_of
from mha_multi.torch import MultiHeadAttention, set_weights

# A small Phi-3 checkpoint: config.json and layer 0's attention, its query, key
# and value projections fused in one qkv_proj (docs/_scripts/phi3_checkpoint.py).
checkpoint = Path(__file__).with_name("phi3")

# [checkpoint]
config = json.loads((checkpoint / "config.json").read_text())
# The file holds one block (under model.layers.0.self_attn.): load_llama finds it
# and splits qkv_proj into W_q, W_k, W_v. Its heads come from the config.
weights = load_llama(checkpoint / "model.safetensors", num_heads=config["num_attention_heads"])
layer = MultiHeadAttention(
    config["hidden_size"],
    num_heads=config["num_attention_heads"],
    num_kv_heads=config["num_key_value_heads"],
    rotary=rotary_of(SimpleNamespace(**config)),  # theta, partial rotary (half of each head)
    window=config["sliding_window"],
)
set_weights(layer, weights).eval()
# [/checkpoint]

# transformers' block on the same input and position_ids, in float64.
expected = np.load(checkpoint / "expected.npz")
x = torch.from_numpy(expected["x"]).float()
with torch.no_grad():
    output = layer(x, x, x, causal=True, positions=torch.from_numpy(expected["positions"]))
np.testing.assert_allclose(output.numpy(), expected["output"], rtol=0, atol=2e-5)
