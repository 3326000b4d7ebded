"""Eager calls past Keras' ``Layer.__call__`` and on each framework's own operations:
which calls go straight to ``call``, and their numbers against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from keras_testing import COPY_KEYWORD_WARNING  # noqa: E402

from mha_multi import spec  # noqa: E402
from mha_multi.keras import MultiHeadAttention, get_weights  # noqa: E402
from mha_multi.keras._direct_call import skips_keras_call  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402

pytestmark = COPY_KEYWORD_WARNING

ROTARY = {"theta": 10000.0}


def _layer(**options):
    layer = MultiHeadAttention(
        8, 2, num_kv_heads=1, query_size=8, key_size=8, value_size=8, **options
    )
    return layer


def _tensor(shape, seed=0):
    rng = np.random.default_rng(seed)
    return backend.to_native(rng.standard_normal(shape).astype(np.float32))


def test_a_repeated_eager_call_skips_keras_call_and_matches_the_reference():
    layer = _layer(rotary=ROTARY)
    x = _tensor((2, 3, 8))
    assert not skips_keras_call(layer, (x, x, x), {})  # never called: Keras' way
    first = backend.to_numpy(layer(x, x, x, causal=True))
    assert skips_keras_call(layer, (x, x, x), {"causal": True})
    second = backend.to_numpy(layer(x, x, x, causal=True))
    np.testing.assert_array_equal(first, second)
    expected, _ = spec.reference_forward(
        get_weights(layer), *(backend.to_numpy(x),) * 3, num_heads=2, causal=True, rotary=ROTARY
    )
    np.testing.assert_allclose(second, expected, atol=5e-6)


def test_a_cached_decoding_step_past_keras_call_matches_the_reference():
    layer = _layer(rotary=ROTARY)
    prompt, token = _tensor((1, 3, 8), 1), _tensor((1, 1, 8), 2)
    cache = layer.init_cache(1, 8)
    _, cache = layer(prompt, prompt, prompt, causal=True, cache=cache)
    assert skips_keras_call(layer, (token, token, token), {"causal": True, "cache": cache})
    output, cache = layer(token, token, token, causal=True, cache=cache)
    whole = np.concatenate([backend.to_numpy(prompt), backend.to_numpy(token)], axis=1)
    expected, _ = spec.reference_forward(
        get_weights(layer), whole, whole, whole, num_heads=2, causal=True, rotary=ROTARY
    )
    np.testing.assert_allclose(backend.to_numpy(output), expected[:, -1:], atol=5e-6)
    assert backend.to_numpy(cache.lengths).tolist() == [4]


def test_calls_keras_must_see_take_its_call():
    layer = _layer(dropout=0.5)
    x = _tensor((1, 2, 8))
    layer(x, x, x)
    # Dropout without a given training flag: an enclosing call's would count.
    assert not skips_keras_call(layer, (x, x, x), {})
    assert skips_keras_call(layer, (x, x, x), {"training": False})
    # Arrays Keras converts, and masks it warns about.
    assert not skips_keras_call(layer, (np.ones((1, 2, 8), np.float32), x, x), {"training": False})
    verdicts = []

    class Outer(keras.layers.Layer):
        def call(self, inputs):
            verdicts.append(skips_keras_call(layer, (inputs, inputs, inputs), {"training": False}))
            return layer(inputs, inputs, inputs, training=False)

    Outer()(x)
    assert verdicts == [False]  # inside another layer's call


def test_a_mixed_precision_layer_takes_keras_call():
    layer = _layer(dtype="mixed_float16")
    x = _tensor((1, 2, 8))
    layer(x, x, x)
    assert not skips_keras_call(layer, (x, x, x), {})


def test_another_keras_takes_keras_way(monkeypatch):
    """Under a Keras whose state the module was not checked against, every call takes
    Keras' way (and still gives the reference's numbers)."""
    layer = _layer()
    x = _tensor((2, 3, 8))
    layer(x, x, x)
    assert skips_keras_call(layer, (x, x, x), {})
    monkeypatch.setattr("mha_multi.keras._direct_call._CHECKED", False)
    assert not skips_keras_call(layer, (x, x, x), {})
    expected, _ = spec.reference_forward(
        get_weights(layer), *(backend.to_numpy(x),) * 3, num_heads=2
    )
    np.testing.assert_allclose(backend.to_numpy(layer(x, x, x)), expected, atol=5e-6)


# (-1e6 overflows float16; JAX without 64-bit arrays makes float64 float32, both ways alike.)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64:UserWarning")
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_the_frameworks_own_operations_are_keras_ops_to_the_bit(dtype):
    """The backend's own ``where`` (numbers and arrays as fills, rounded to the
    array's dtype), ``arange`` and comparisons give the arrays ``keras.ops`` gives:
    the same dtype and the same bits."""
    from mha_multi.keras._framework_ops import COMPARISONS, framework_ops

    own = framework_ops()
    rng = np.random.default_rng(3)
    x = keras.ops.cast(
        backend.to_native(rng.standard_normal((2, 3, 5)) * 1e3, dtype="float64"), dtype
    )
    condition = keras.ops.convert_to_tensor(rng.standard_normal((2, 3, 5)) > 0)
    other = backend.to_native(rng.standard_normal((2, 3, 5)), dtype="float64")
    for fill in (-1e6, 0.0, -0.0, 1e-8, 0.1, float("nan"), -float("inf"), 3, True, other):
        for _ in range(2):  # (a number's program is compiled at its first use)
            expected = keras.ops.where(condition, x, keras.ops.cast(fill, dtype))
            got = own.where(condition, x, fill)
            assert got.dtype == expected.dtype
            got, expected = backend.to_numpy(got), backend.to_numpy(expected)
            np.testing.assert_array_equal(got, expected)
            np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))  # (-0.0)
    for size in (0, 1, 7):
        got, expected = own.arange(size), keras.ops.arange(size, dtype="int32")
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(backend.to_numpy(got), backend.to_numpy(expected))
    positions = keras.ops.arange(6, dtype="int32")
    lengths = keras.ops.convert_to_tensor(np.array([[[0]], [[3]], [[7]]], np.int32))
    cases = list(
        zip(
            COMPARISONS,
            [(positions, lengths), (lengths, positions), (condition, condition[:1])],
            strict=True,
        )
    )
    cases += [
        ("less", (positions, 4)),
        ("less", (positions, 2**30)),
        ("greater_equal", (lengths, -1)),
    ]
    for name, (a, b) in cases:
        got, expected = own.compare(name, a, b), getattr(keras.ops, name)(a, b)
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(backend.to_numpy(got), backend.to_numpy(expected))
