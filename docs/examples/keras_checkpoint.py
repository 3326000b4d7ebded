"""A transformers checkpoint into Keras 3 (any backend): Phi-3's attention from .safetensors."""

import json
from pathlib import Path
from types import SimpleNamespace

import keras
import numpy as np
from safetensors.numpy import load_file

from mha_multi.interop.llama_state import from_llama_state
from mha_multi.interop.rotary_config import rotary_of
from mha_multi.keras import MultiHeadAttention, set_weights

# A small Phi-3 checkpoint (docs/_scripts/phi3_checkpoint.py): config.json, and
# layer 0's attention with its query, key and value projections fused in qkv_proj.
checkpoint = Path(__file__).with_name("phi3")

# [checkpoint]
config = json.loads((checkpoint / "config.json").read_text())
# Entries outside the prefix (a whole model's other layers) are ignored; the
# fused qkv_proj is split into W_q, W_k, W_v.
weights = from_llama_state(
    load_file(checkpoint / "model.safetensors"),
    num_heads=config["num_attention_heads"],
    prefix="model.layers.0.self_attn.",
)
options = {
    "num_kv_heads": config["num_key_value_heads"],
    "rotary": rotary_of(SimpleNamespace(**config)),
    "window": config["sliding_window"],
}
layer = MultiHeadAttention(config["hidden_size"], config["num_attention_heads"], **options)
set_weights(layer, weights)  # also builds the layer
# [/checkpoint]

# transformers' block on the same input and position_ids, in float64.
expected = np.load(checkpoint / "expected.npz")
x = expected["x"].astype(np.float32)
output = keras.ops.convert_to_numpy(layer(x, x, x, causal=True, positions=expected["positions"]))
np.testing.assert_allclose(output, expected["output"], rtol=0, atol=2e-5)
