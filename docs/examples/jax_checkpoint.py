"""A transformers checkpoint into Flax NNX, without PyTorch: Phi-3's attention from .safetensors."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from mha_multi.interop.llama_state import from_llama_state
from mha_multi.interop.rotary_config import rotary_of
from mha_multi.jax import MultiHeadAttention, set_weights

# A small Phi-3 checkpoint (docs/_scripts/phi3_checkpoint.py): config.json, and
# layer 0's attention with its query, key and value projections fused in qkv_proj.
checkpoint = Path(__file__).with_name("phi3")

# [checkpoint]
config = json.loads((checkpoint / "config.json").read_text())
state = load_file(checkpoint / "model.safetensors")  # numpy arrays: no PyTorch needed
weights = from_llama_state(
    state, num_heads=config["num_attention_heads"], prefix="model.layers.0.self_attn."
)
layer = MultiHeadAttention(
    config["hidden_size"],
    config["num_attention_heads"],
    num_kv_heads=config["num_key_value_heads"],
    rotary=rotary_of(SimpleNamespace(**config)),
    window=config["sliding_window"],
    rngs=nnx.Rngs(0),
)
set_weights(layer, weights)
layer.eval()
# [/checkpoint]

# transformers' block on the same input and position_ids, in float64.
expected = np.load(checkpoint / "expected.npz")
x = expected["x"].astype(np.float32)
output = layer(x, x, x, causal=True, positions=expected["positions"])
np.testing.assert_allclose(np.asarray(output), expected["output"], rtol=0, atol=2e-5)
