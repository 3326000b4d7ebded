"""The NNX layer's call plan: a repeated eager call runs one compiled program, traced once.

Numbers are checked against the float64 reference
(:func:`mha_multi.spec.reference_forward`); the traces are counted by
:func:`mha_multi.call.forward`, which an eager call of the plan runs only
while its program is traced (docs: "Fast paths").
"""

from __future__ import annotations

from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import counted_flow_runs
from mha_multi import spec
from mha_multi.jax import MultiHeadAttention, _plan, set_weights
from mha_multi.parity.compare import TOLERANCES
from mha_multi.weights import init_weights

HEADS = {"num_heads": 2, "num_kv_heads": 1}
ROTARY = {"rotary": {"theta": 10000.0}}
FORWARD = TOLERANCES["float32"][0]


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """One entry per run of the call flow; the plans made anew (none traced yet)."""
    yield from counted_flow_runs(monkeypatch, _plan.forget)


def reference(weights, x, **kwargs):
    return spec.reference_forward(weights, x, x, x, **HEADS, **ROTARY, **kwargs)[0]


def test_a_repeated_call_is_traced_once_and_sees_new_weights(traces):
    weights = init_weights(8, **HEADS, seed=0)
    layer = MultiHeadAttention.from_canonical(weights, **HEADS, **ROTARY)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    x_jax = jnp.asarray(x)
    for _ in range(3):
        np.testing.assert_allclose(layer(x_jax, x_jax, x_jax), reference(weights, x), atol=FORWARD)
    assert len(traces) == 1
    # The weights are the program's arguments: a new value is seen, with no new trace.
    changed = init_weights(8, **HEADS, seed=1)
    set_weights(layer, changed)
    np.testing.assert_allclose(layer(x_jax, x_jax, x_jax), reference(changed, x), atol=FORWARD)
    assert len(traces) == 1


def test_decoding_steps_share_one_trace_and_check_lengths_each_call(traces):
    weights = init_weights(8, **HEADS, seed=2)
    layer = MultiHeadAttention.from_canonical(weights, **HEADS, **ROTARY)
    x = np.random.default_rng(1).standard_normal((1, 5, 8)).astype(np.float32)
    expected = reference(weights, x, causal=True)
    cache = layer.init_cache(1, 5)
    output, cache = layer(*(jnp.asarray(x[:, :2]),) * 3, causal=True, cache=cache)
    np.testing.assert_allclose(output, expected[:, :2], atol=FORWARD)
    for t in range(2, 5):
        token = jnp.asarray(x[:, t : t + 1])
        output, cache = layer(token, token, token, causal=True, cache=cache)
        np.testing.assert_allclose(output, expected[:, t : t + 1], atol=FORWARD)
    assert len(traces) == 2  # the prompt's length and 1
    # The lengths are values: checked on every call, the planned ones included.
    with pytest.raises(ValueError, match="overflows"):
        layer(token, token, token, causal=True, cache=cache)
