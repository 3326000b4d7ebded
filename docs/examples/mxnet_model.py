"""A transformers checkpoint folder into MXNet Gluon: every attention layer of a small Qwen 3."""

from pathlib import Path

import numpy as np
from mxnet import np as mnp

from mha_multi.interop.transformers import attention_layers
from mha_multi.mxnet import MultiHeadAttention

# A 2-layer Qwen 3 causal LM saved by transformers' save_pretrained:
# config.json and model.safetensors (tests/fixtures/transformers_checkpoints.py).
checkpoint = Path(__file__).with_name("qwen3")

# [model]
layers = {}
for index, weights, kwargs in attention_layers(checkpoint):
    layers[index] = MultiHeadAttention.from_canonical(weights, **kwargs)
    layers[index].hybridize()
# [/model]

# Each layer's transformers block on the same input and position_ids, in float64.
expected = np.load(checkpoint / "expected.npz")
x = mnp.array(expected["x"].astype(np.float32))
positions = mnp.array(expected["positions"], dtype=np.int32)
for index, layer in layers.items():
    output = layer(x, x, x, causal=True, positions=positions).asnumpy()
    np.testing.assert_allclose(output, expected[f"{index}.output"], rtol=0, atol=2e-5)
