"""A transformers checkpoint folder into PyTorch: every attention layer of a small Qwen 3."""

from pathlib import Path

import numpy as np
import torch

from mha_multi.interop.transformers import attention_layers
from mha_multi.torch import MultiHeadAttention

# A 2-layer Qwen 3 causal LM saved by transformers' save_pretrained:
# config.json and model.safetensors (tests/fixtures/transformers_checkpoints.py).
checkpoint = Path(__file__).with_name("qwen3")

# [model]
layers = {
    index: MultiHeadAttention.from_canonical(weights, **kwargs).eval()
    for index, weights, kwargs in attention_layers(checkpoint)  # one layer read at a time
}
# [/model]

# Each layer's transformers block on the same input and position_ids, in float64.
expected = np.load(checkpoint / "expected.npz")
x = torch.from_numpy(expected["x"]).float()
positions = torch.from_numpy(expected["positions"])
for index, layer in layers.items():
    with torch.no_grad():
        output = layer(x, x, x, causal=True, positions=positions)
    np.testing.assert_allclose(output.numpy(), expected[f"{index}.output"], rtol=0, atol=2e-5)
