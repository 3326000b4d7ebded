"""Weights from torch.nn.MultiheadAttention and d2l's layer into mha_multi, and back."""

import numpy as np
import torch

from mha_multi.interop.torch import (
    from_torch_d2l_state,
    from_torch_mha,
    key_padding_mask,
    to_torch_d2l_state,
    to_torch_mha,
)
from mha_multi.torch import MultiHeadAttention, get_weights, set_weights

torch.manual_seed(0)
native = torch.nn.MultiheadAttention(32, num_heads=4, bias=True, batch_first=True).eval()

# Canonical weights out of the native layer, into ours.
weights = from_torch_mha(native)
print(sorted(weights))  # ['W_k', 'W_o', 'W_q', 'W_v', 'b_k', 'b_o', 'b_q', 'b_v']
ours = set_weights(MultiHeadAttention(32, num_heads=4, bias=True), weights).eval()

x = torch.randn(2, 6, 32)
valid_lens = torch.tensor([6, 3])
# The native layer takes a key padding mask: True where a key is *hidden*.
padding = key_padding_mask(valid_lens, num_keys=6)
assert padding.tolist()[1] == [False, False, False, True, True, True]

with torch.no_grad():
    expected, native_weights = native(x, x, x, key_padding_mask=padding)
    output, attention = ours(x, x, x, valid_lens, return_attention_weights=True)
torch.testing.assert_close(output, expected, rtol=0, atol=5e-6)
# The native layer averages its weights over heads; ours are per head.
assert attention.shape == (2, 4, 6, 6) and native_weights.shape == (2, 6, 6)
torch.testing.assert_close(attention.mean(1), native_weights, rtol=0, atol=1e-6)

# And back: a native layer holding our weights.
again = to_torch_mha(get_weights(ours), num_heads=4)
for name, tensor in native.state_dict().items():
    torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=0)

# d2l's torch layer names its projections W_q, W_k, W_v, W_o like ours: its
# state_dict loads as it is, or converts to canonical weights.
d2l_state = to_torch_d2l_state(weights)
d2l_like = MultiHeadAttention(32, num_heads=4, bias=True)
d2l_like.load_state_dict(d2l_state)
for name, array in from_torch_d2l_state(d2l_like.state_dict()).items():
    np.testing.assert_array_equal(array, weights[name])
