"""A transformers checkpoint into MXNet Gluon: Phi-3's attention from .safetensors and config."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from mxnet import np as mnp
from safetensors.numpy import load_file

from mha_multi.interop.llama_state import from_llama_state
from mha_multi.interop.rotary_config import rotary_of
from mha_multi.mxnet import MultiHeadAttention, set_weights

# A small Phi-3 checkpoint (docs/_scripts/phi3_checkpoint.py): config.json, and
# layer 0's attention with its query, key and value projections fused in qkv_proj.
checkpoint = Path(__file__).with_name("phi3")

# [checkpoint]
config = json.loads((checkpoint / "config.json").read_text())
state = load_file(checkpoint / "model.safetensors")
heads = config["num_attention_heads"]
weights = from_llama_state(state, num_heads=heads, prefix="model.layers.0.self_attn.")
rotary = rotary_of(SimpleNamespace(**config))  # {"theta": 10000.0, "fraction": 0.5}
layer = MultiHeadAttention(
    config["hidden_size"],
    heads,
    num_kv_heads=config["num_key_value_heads"],
    rotary=rotary,
    window=config["sliding_window"],
)
set_weights(layer, weights)  # creates the parameters
layer.hybridize()
# [/checkpoint]

# transformers' block on the same input and position_ids, in float64.
expected = np.load(checkpoint / "expected.npz")
x = mnp.array(expected["x"].astype(np.float32))
positions = mnp.array(expected["positions"], dtype=np.int32)
output = layer(x, x, x, causal=True, positions=positions).asnumpy()
np.testing.assert_allclose(output, expected["output"], rtol=0, atol=2e-5)
