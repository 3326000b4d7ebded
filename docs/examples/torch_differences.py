"""Where torch.nn.MultiheadAttention and mha_multi differ, on the same weights."""

import numpy as np
import torch

from mha_multi.interop.torch import key_padding_mask, to_torch_mha
from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

weights = init_weights(16, seed=0)
ours = set_weights(MultiHeadAttention(16, num_heads=2), weights).eval()
native = to_torch_mha(weights, num_heads=2).eval()

x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
valid_lens = torch.tensor([4, 0])  # example 1: every key hidden

with torch.no_grad():
    output, attention = ours(x, x, x, valid_lens, return_attention_weights=True)
    native_output, _ = native(x, x, x, key_padding_mask=key_padding_mask(valid_lens, 4))

# 1. A query that sees no key: uniform weights over all keys (d2l's rule),
#    so the output is the mean of all value rows; the native layer gives NaN.
np.testing.assert_allclose(attention[1].numpy(), 0.25, rtol=0, atol=1e-7)
assert torch.isnan(native_output[1]).all()
# Where some key is visible the two layers agree.
torch.testing.assert_close(output[0], native_output[0], rtol=0, atol=5e-6)

# 2. Mask polarity: valid_lens counts visible keys; key_padding_mask is True
#    where a key is hidden.
assert key_padding_mask(torch.tensor([1]), 3).tolist() == [[False, True, True]]

# 3. Causal alignment with fewer queries than keys: ours is bottom-right
#    aligned (the last query sees every key); a top-left mask (tril) is not.
queries = x[:, :2]
with torch.no_grad():
    _, causal_weights = ours(queries, x, x, causal=True, return_attention_weights=True)
visible = (causal_weights[0, 0] > 0).numpy()
np.testing.assert_array_equal(visible, [[True, True, True, False], [True, True, True, True]])
top_left = np.tril(np.ones((2, 4), bool))
assert not (visible == top_left).all()
