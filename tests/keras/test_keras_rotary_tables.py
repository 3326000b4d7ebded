"""Traced and symbolic calls of a rotary Keras layer keep no tables; eager ones keep theirs.

Only concrete eager arrays are kept for later calls (docs: "Fast paths"):
a call under ``tf.function`` or ``jax.jit``, or a symbolic one (Keras'
functional API), makes its own tables and leaves nothing behind.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from keras_testing import eager_flow  # noqa: E402, F401

from mha_multi import spec  # noqa: E402
from mha_multi.call import rotary_tables  # noqa: E402
from mha_multi.keras import MultiHeadAttention, set_weights  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402
from mha_multi.weights import init_weights  # noqa: E402

ROTARY = {"theta": 100.0}


def _traced(layer):
    """The layer's self-attention call, compiled the backend's way (``None`` on PyTorch)."""
    call = lambda x: layer(x, x, x, causal=True)  # noqa: E731
    if backend.BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(call)
    if backend.BACKEND == "jax":
        import jax

        return jax.jit(call)
    return None


@pytest.mark.usefixtures("eager_flow")
def test_traced_and_symbolic_calls_keep_nothing():
    weights = init_weights(16, num_heads=2, num_kv_heads=1, seed=13)
    weights = {name: array.astype(np.float32) for name, array in weights.items()}
    layer = set_weights(MultiHeadAttention(16, 2, num_kv_heads=1, rotary=ROTARY), weights)
    x = np.random.default_rng(13).standard_normal((1, 4, 16)).astype(np.float32)
    expected, _ = spec.reference_forward(
        weights, x, x, x, num_heads=2, num_kv_heads=1, causal=True, rotary=ROTARY
    )
    rotary_tables.forget()
    symbolic = keras.Input((4, 16))
    assert tuple(layer(symbolic, symbolic, symbolic, causal=True).shape) == (None, 4, 16)
    traced = _traced(layer)
    if traced is not None:
        output = traced(backend.to_native(x))
        np.testing.assert_allclose(backend.to_numpy(output), expected, atol=5e-6, rtol=0)
    assert rotary_tables.kept() == []
    output = layer(*[backend.to_native(x)] * 3, causal=True)
    np.testing.assert_allclose(backend.to_numpy(output), expected, atol=5e-6, rtol=0)
    assert len(rotary_tables.kept()) == 1
