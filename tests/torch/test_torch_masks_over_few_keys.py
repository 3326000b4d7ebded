"""PyTorch on a CPU: a mask over 8 to 15 keys goes to the generic path (docs: "Fast paths").

SDPA's CPU kernel applies an explicit mask over rows shorter than its vector
width on a slow path, so an eager call of more than one query over 8 to 15
keys that needs a mask or a bias takes the generic path; fewer keys, more, one
query, or a call that needs no mask keep SDPA. Either way the numbers are the
float64 reference's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha_multi import spec
from mha_multi.parity.compare import TOLERANCES
from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, get_weights
from mha_multi.torch._ops import CPU_SLOW_MASK_KEYS

#: Key counts about the band's edges, and within it.
NUM_KEYS = [4, 7, 8, 10, 15, 16, 20]

#: Each kind of call: its number of queries (``None``: as many as keys) and whether it
#: passes a bias rather than lengths.
CALLS = {
    "self-attention with lengths": (None, False),
    "cross-attention with lengths": (3, False),
    "self-attention with a bias": (None, True),
    "one query with lengths": (1, False),
}


@pytest.mark.parametrize("num_keys", NUM_KEYS)
@pytest.mark.parametrize("kind", CALLS)
@pytest.mark.parametrize("recording", [False, True], ids=["no gradient", "recording"])
def test_a_mask_over_few_keys_takes_the_kernel_only_outside_the_band(num_keys, kind, recording):
    num_queries, biased = CALLS[kind]
    num_queries = num_keys if num_queries is None else num_queries
    torch.manual_seed(num_keys)
    layer = MultiHeadAttention(16, 2).eval()
    x, memory = torch.randn(3, num_queries, 16), torch.randn(3, num_keys, 16)
    if num_queries == num_keys and kind.startswith("self"):
        memory = x
    given: dict[str, np.ndarray] = {}
    if biased:
        given["bias"] = np.random.default_rng(num_keys).standard_normal(
            (1, 2, num_queries, num_keys)
        )
    else:
        given["valid_lens"] = np.array([num_keys, num_keys // 2, 1])
    arguments = {name: torch.from_numpy(value).float() for name, value in given.items()}
    if "valid_lens" in arguments:
        arguments["valid_lens"] = arguments["valid_lens"].long()
    queries = x.clone().requires_grad_(recording)
    with torch.set_grad_enabled(recording), backend.kernel_spy() as calls:
        out = layer(queries, memory, memory, **arguments)
    expected, _ = spec.reference_forward(
        get_weights(layer),
        x.double().numpy(),
        memory.double().numpy(),
        memory.double().numpy(),
        num_heads=2,
        **given,
    )
    forward, _ = TOLERANCES["float32"]
    np.testing.assert_allclose(out.detach().double().numpy(), expected, rtol=0, atol=forward)
    generic = num_keys in CPU_SLOW_MASK_KEYS and num_queries > 1
    assert any(call.mask for call in calls) is not generic
