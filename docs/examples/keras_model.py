"""A transformers checkpoint folder into Keras 3 (any backend): every layer of a Qwen 3."""

from pathlib import Path

import keras
import numpy as np

from mha_multi.interop.transformers import attention_layers
from mha_multi.keras import MultiHeadAttention

# A 2-layer Qwen 3 causal LM saved by transformers' save_pretrained:
# config.json and model.safetensors (tests/fixtures/transformers_checkpoints.py).
checkpoint = Path(__file__).with_name("qwen3")

# [model]
layers = {
    index: MultiHeadAttention.from_canonical(weights, **kwargs)  # built with its weights
    for index, weights, kwargs in attention_layers(checkpoint)
}
# [/model]

# Each layer's transformers block on the same input and position_ids, in float64.
expected = np.load(checkpoint / "expected.npz")
x = expected["x"].astype(np.float32)
for index, layer in layers.items():
    output = layer(x, x, x, causal=True, positions=expected["positions"])
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(output), expected[f"{index}.output"], rtol=0, atol=2e-5
    )
