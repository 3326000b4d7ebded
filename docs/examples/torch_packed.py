"""PyTorch: a packed batch through the layer, each sequence what it is alone."""

import numpy as np
import torch

from mha_multi import spec
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

weights = init_weights(16, num_heads=4, num_kv_heads=2, seed=0)
layer = MultiHeadAttention(16, 4, num_kv_heads=2, rotary={"theta": 10000.0})
set_weights(layer, weights).eval()

# Two rows: sequences of 5, 2 and 4 tokens, then 7 and 3 (and one of padding).
segment_ids = torch.from_numpy(spec.segment_ids_from_lengths([[5, 2, 4], [7, 3]], length=11))
x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(0))
output = layer(x, x, x, causal=True, segment_ids=segment_ids)  # rotary restarts at each

expected, _ = spec.reference_forward(
    weights,
    x.numpy(),
    x.numpy(),
    x.numpy(),
    num_heads=4,
    causal=True,
    rotary={"theta": 10000.0},
    segment_ids=segment_ids.numpy(),
)
np.testing.assert_allclose(output.detach().numpy(), expected, rtol=0, atol=5e-6)
alone = layer(x[1:, 7:], x[1:, 7:], x[1:, 7:], causal=True)  # the row's second sequence
torch.testing.assert_close(output[1:, 7:10], alone[:, :3], rtol=0, atol=5e-6)
