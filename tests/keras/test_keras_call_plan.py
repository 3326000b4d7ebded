"""Keras' call plan: on JAX and TensorFlow, an eager call runs one compiled program per signature.

Numbers are checked against the float64 reference
(:func:`mha_multi.spec.reference_forward`,
:func:`mha_multi.spec.reference_cached_forward`); the traces are counted by
:func:`mha_multi.call.forward`, which a planned call runs only while its
program is traced (docs: "Fast paths"). On the backends without a plan every
eager call runs the flow. The tests plan a signature at its first call; a
framework whose trace costs many eager calls plans it later (one test).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from keras_testing import COPY_KEYWORD_WARNING  # noqa: E402

from conftest import counted_flow_runs, recorded_calls  # noqa: E402
from mha_multi import spec  # noqa: E402
from mha_multi.keras import MultiHeadAttention, _call_plan, set_weights  # noqa: E402
from mha_multi.keras._frameworks import active  # noqa: E402
from mha_multi.keras._written_lengths import WRITTEN_LENGTHS  # noqa: E402
from mha_multi.parity.compare import TOLERANCES  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402
from mha_multi.weights import init_weights  # noqa: E402

pytestmark = COPY_KEYWORD_WARNING

HEADS = {"num_heads": 2, "num_kv_heads": 1}
ROTARY = {"theta": 10000.0}
FORWARD, GRADIENT = TOLERANCES["float32"]
#: Whether this backend's eager calls are planned.
PLANNED = active().compile_call is not None
#: How many eager calls of a signature run the flow before its program serves it.
EAGER_CALLS = active().eager_calls_before_plan


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """One entry per run of the call flow; the programs made anew (none traced yet), and
    a signature planned at its first call."""
    monkeypatch.setattr(type(active()), "eager_calls_before_plan", 0)
    yield from counted_flow_runs(monkeypatch, _call_plan.forget)


def _weights(seed: int) -> dict[str, np.ndarray]:
    weights = init_weights(8, **HEADS, seed=seed)
    return {name: array.astype(np.float32) for name, array in weights.items()}


def _layer(weights: dict[str, np.ndarray], **options) -> MultiHeadAttention:
    return set_weights(MultiHeadAttention(8, 2, num_kv_heads=1, rotary=ROTARY, **options), weights)


def _reference(weights, x, **kwargs):
    return spec.reference_forward(weights, x, x, x, **HEADS, rotary=ROTARY, **kwargs)[0]


def _native(*arrays):
    return [backend.to_native(x) for x in arrays]


def test_a_repeated_call_is_traced_once_and_sees_new_weights(traces):
    weights = _weights(0)
    layer = _layer(weights)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    (x_native,) = _native(x)
    lens = np.array([3, 2], np.int32)
    for _ in range(3):
        output = layer(x_native, x_native, x_native, backend.lens_to_native(lens), causal=True)
        expected = _reference(weights, x, valid_lens=lens, causal=True)
        np.testing.assert_allclose(backend.to_numpy(output), expected, atol=FORWARD, rtol=0)
    assert len(traces) == (1 if PLANNED else 3)
    # Lengths as numpy, which the layer passes on as they are (as the index dtype: a
    # trace of their own where that is not the JAX lengths'), give the same numbers.
    np.testing.assert_array_equal(
        backend.to_numpy(layer(x_native, x_native, x_native, lens, causal=True)),
        backend.to_numpy(output),
    )
    traced = len(traces)
    # The variables are the program's arguments: a new value is seen, with no new trace.
    changed = _weights(1)
    set_weights(layer, changed)
    output = layer(x_native, x_native, x_native, backend.lens_to_native(lens), causal=True)
    expected = _reference(changed, x, valid_lens=lens, causal=True)
    np.testing.assert_allclose(backend.to_numpy(output), expected, atol=FORWARD, rtol=0)
    assert len(traces) == (traced if PLANNED else 5)


def test_decoding_steps_share_one_trace_and_check_lengths_each_call(traces):
    weights = _weights(2)
    layer = _layer(weights)
    x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
    expected = _reference(weights, x, causal=True)
    cache = layer.init_cache(2, 5)
    output, cache = layer(*_native(x[:, :2], x[:, :2], x[:, :2]), causal=True, cache=cache)
    np.testing.assert_allclose(backend.to_numpy(output), expected[:, :2], atol=FORWARD, rtol=0)
    for t in range(2, 5):
        token = _native(x[:, t : t + 1])[0]
        output, cache = layer(token, token, token, causal=True, cache=cache)
        np.testing.assert_allclose(
            backend.to_numpy(output), expected[:, t : t + 1], atol=FORWARD, rtol=0
        )
        # The lengths a planned step returns are known on the host, as an eager step's.
        np.testing.assert_array_equal(WRITTEN_LENGTHS.known(cache.lengths), [t + 1, t + 1])
    assert len(traces) == (2 if PLANNED else 4)  # the prompt's length and 1
    # The lengths are values: checked on every call, the planned ones included.
    with pytest.raises(ValueError, match="the cache overflows: example 0 would hold 6"):
        layer(token, token, token, causal=True, cache=cache)


def test_a_ragged_step_of_a_planned_call_matches_the_reference(traces):
    weights = _weights(3)
    layer = _layer(weights)
    rng = np.random.default_rng(2)
    prompt = rng.standard_normal((2, 3, 8)).astype(np.float32)
    cache = layer.init_cache(2, 6)
    _, cache = layer(*_native(prompt, prompt, prompt), causal=True, cache=cache)
    rows = rng.standard_normal((2, 2, 8)).astype(np.float32)
    lens = np.array([2, 1], np.int32)
    before = [backend.to_numpy(a) for a in cache]
    for _ in range(2):  # (the second call runs the program the first traced)
        output, after = layer(
            *_native(rows, rows, rows), backend.lens_to_native(lens), causal=True, cache=cache
        )
        expected, _, expected_cache = spec.reference_cached_forward(
            weights,
            rows,
            rows,
            rows,
            spec.KVCache(*before),
            lens,
            **HEADS,
            causal=True,
            rotary=ROTARY,
        )
        np.testing.assert_allclose(backend.to_numpy(output)[0], expected[0], atol=FORWARD, rtol=0)
        np.testing.assert_allclose(
            backend.to_numpy(output)[1, :1], expected[1, :1], atol=FORWARD, rtol=0
        )
        np.testing.assert_array_equal(backend.to_numpy(after.lengths), [5, 4])
        np.testing.assert_array_equal(WRITTEN_LENGTHS.known(after.lengths), [5, 4])
        for held, reference in zip(after[:2], expected_cache[:2], strict=True):
            np.testing.assert_allclose(
                backend.to_numpy(held)[:, :, :5], reference[:, :, :5], atol=FORWARD, rtol=0
            )
    assert len(traces) == (2 if PLANNED else 3)


def test_non_finite_inputs_give_the_references_pattern(traces):
    weights = _weights(4)
    layer = _layer(weights)
    x = np.random.default_rng(3).standard_normal((3, 4, 8)).astype(np.float32)
    x[0, 1, 2] = np.nan
    x[1, 2, 0] = np.inf
    x[2, 0, 5] = -np.inf
    expected = _reference(weights, x, causal=True)
    for _ in range(2):
        output = backend.to_numpy(layer(*_native(x, x, x), causal=True))
        np.testing.assert_array_equal(np.isnan(output), np.isnan(expected))
        np.testing.assert_array_equal(np.isinf(output), np.isinf(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(output[finite], expected[finite], atol=FORWARD, rtol=0)


def test_a_planned_signatures_new_shapes_raise_the_flows_errors(traces):
    layer = _layer(_weights(5))
    x = _native(np.ones((1, 3, 8), np.float32))[0]
    layer(x, x, x)
    wide = _native(np.ones((1, 3, 9), np.float32))[0]
    with pytest.raises(ValueError, match="keys"):
        layer(x, wide, x)
    with pytest.raises(TypeError, match="causal"):
        layer(x, x, x, causal="yes")


def test_calls_that_apply_dropout_are_not_planned(traces):
    weights = _weights(6)
    layer = _layer(weights, dropout=0.5)
    x = np.random.default_rng(4).standard_normal((1, 3, 8)).astype(np.float32)
    (x_native,) = _native(x)
    for _ in range(2):  # without dropout applied: planned (where this backend plans)
        output = layer(x_native, x_native, x_native, training=False)
        np.testing.assert_allclose(
            backend.to_numpy(output), _reference(weights, x), atol=FORWARD, rtol=0
        )
    assert len(traces) == (1 if PLANNED else 2)
    traces.clear()
    for _ in range(2):
        layer(x_native, x_native, x_native, training=True)
    assert len(traces) == 2  # the eager flow, with its dropout, each time


def test_a_planned_layer_is_freed_with_its_programs(traces):
    layer = _layer(_weights(7))
    (x,) = _native(np.ones((1, 2, 8), np.float32))
    for _ in range(2):
        layer(x, x, x)
    held = weakref.ref(layer)
    del layer
    gc.collect()
    assert held() is None


def test_layers_of_the_same_settings_share_their_programs(traces):
    # Each layer's own weights and the reference's numbers for each; one trace in all.
    x = np.random.default_rng(9).standard_normal((2, 3, 8)).astype(np.float32)
    (x_native,) = _native(x)
    for seed in (10, 11, 12):
        weights = _weights(seed)
        layer = _layer(weights)
        output = layer(x_native, x_native, x_native, causal=True)
        expected = _reference(weights, x, causal=True)
        np.testing.assert_allclose(backend.to_numpy(output), expected, atol=FORWARD, rtol=0)
    assert len(traces) == (1 if PLANNED else 3)
    # Settings a trace reads (the rotary base here) are a program of their own.
    weights = _weights(13)
    other = set_weights(MultiHeadAttention(8, 2, num_kv_heads=1, rotary={"theta": 500.0}), weights)
    output = other(x_native, x_native, x_native, causal=True)
    expected = spec.reference_forward(
        weights, x, x, x, **HEADS, rotary={"theta": 500.0}, causal=True
    )[0]
    np.testing.assert_allclose(backend.to_numpy(output), expected, atol=FORWARD, rtol=0)
    assert len(traces) == (2 if PLANNED else 4)

    # And so is a layer of another class, whose call may differ.
    class Subclass(MultiHeadAttention):
        pass

    sub = set_weights(Subclass(8, 2, num_kv_heads=1, rotary=ROTARY), _weights(10))
    sub(x_native, x_native, x_native, causal=True)
    assert len(traces) == (3 if PLANNED else 5)


def test_layers_freezing_different_variables_share_a_program_and_keep_their_weights(traces):
    # W_k and W_v have one shape: a program traced for one layer's split of trainable
    # variables, taken by another's, must not put one's values in the other's place.
    x = np.random.default_rng(14).standard_normal((2, 3, 8)).astype(np.float32)
    (x_native,) = _native(x)
    weights = _weights(15)
    expected = _reference(weights, x, causal=True)
    frozen_k, frozen_v = _layer(weights), _layer(weights)
    frozen_k.W_k.trainable = False
    frozen_v.W_v.trainable = False
    for layer in (frozen_k, frozen_v, frozen_k, frozen_v):
        output = layer(x_native, x_native, x_native, causal=True)
        np.testing.assert_allclose(backend.to_numpy(output), expected, atol=FORWARD, rtol=0)
    # One layer whose frozen variable changes between calls.
    frozen_k.W_k.trainable, frozen_k.W_v.trainable = True, False
    output = frozen_k(x_native, x_native, x_native, causal=True)
    np.testing.assert_allclose(backend.to_numpy(output), expected, atol=FORWARD, rtol=0)
    assert len(traces) == (1 if PLANNED else 5)


def test_a_direct_call_of_numpy_inputs_takes_them_as_a_call_does(traces):
    """stateless_call passes its arguments to call as they are (no ``__call__`` makes
    numpy inputs tensors): the flow makes floating ones tensors, as Keras' own layers
    take them there (it refused them), and refuses others with the call's message."""
    weights = _weights(8)
    layer = _layer(weights)
    x = np.random.default_rng(8).standard_normal((2, 3, 8)).astype(np.float32)
    layer(*_native(x, x, x))  # (built and called)
    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]
    output, _ = layer.stateless_call(trainable, non_trainable, x, x, x)
    np.testing.assert_allclose(backend.to_numpy(output), _reference(weights, x), atol=1e-5)
    with pytest.raises(TypeError, match="queries must be a floating-point array; got int64"):
        layer.stateless_call(trainable, non_trainable, x.astype(np.int64), x, x)


def test_a_traced_call_on_a_cpu_takes_the_batch_in_pieces(traces, monkeypatch):
    # Every example a piece on JAX's CPU, where the call plan's program is traced.
    monkeypatch.setattr(spec, "CPU_PIECE_BYTES", 1)
    pieced = recorded_calls(monkeypatch, spec, "in_pieces", lambda *args: args[2])
    weights = _weights(9)
    layer = _layer(weights)
    x = np.random.default_rng(6).standard_normal((4, 3, 8)).astype(np.float32)
    lens = np.array([3, 1, 2, 3], np.int32)
    for _ in range(2):
        output = layer(*_native(x, x, x), backend.lens_to_native(lens), causal=True)
        expected = _reference(weights, x, valid_lens=lens, causal=True)
        np.testing.assert_allclose(backend.to_numpy(output), expected, atol=FORWARD, rtol=0)
    # (Traced once; a TensorFlow graph takes the whole batch.)
    assert pieced == ([4] if keras.backend.backend() == "jax" else [])


def test_a_signature_is_planned_after_the_eager_calls_its_framework_names(traces, monkeypatch):
    monkeypatch.setattr(type(active()), "eager_calls_before_plan", EAGER_CALLS)
    weights = _weights(14)
    layer = _layer(weights)
    x = np.random.default_rng(7).standard_normal((2, 3, 8)).astype(np.float32)
    (x_native,) = _native(x)
    expected = _reference(weights, x, causal=True)
    for call in range(EAGER_CALLS + 3):
        output = layer(x_native, x_native, x_native, causal=True)
        np.testing.assert_allclose(backend.to_numpy(output), expected, atol=FORWARD, rtol=0)
        # The eager flow's calls first, then one trace, which the calls after it run.
        assert len(traces) == (min(call + 1, EAGER_CALLS + 1) if PLANNED else call + 1)
    # A layer of the same settings finds the signature counted and its program traced.
    weights = _weights(16)
    output = _layer(weights)(x_native, x_native, x_native, causal=True)
    np.testing.assert_allclose(
        backend.to_numpy(output), _reference(weights, x, causal=True), atol=FORWARD, rtol=0
    )
    assert len(traces) == (EAGER_CALLS + 1 if PLANNED else EAGER_CALLS + 4)
    # A shape met once runs the eager flow; so does each call of it until it is planned.
    (longer,) = _native(np.ones((2, 4, 8), np.float32))
    traces.clear()
    for _ in range(EAGER_CALLS + 2):
        layer(longer, longer, longer, causal=True)
    assert len(traces) == (EAGER_CALLS + 1 if PLANNED else EAGER_CALLS + 2)


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow's planned calls alone record a gradient: JAX's gradients trace "
    "the call (no plan takes a tracer), and Keras on PyTorch plans no call",
)
def test_a_planned_call_records_the_references_gradients(traces):
    import tensorflow as tf

    weights = _weights(15)
    layer = _layer(weights)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    cotangent = rng.standard_normal((2, 3, 8)).astype(np.float32)
    expected = spec.reference_gradients(
        weights, x, x, x, **HEADS, rotary=ROTARY, causal=True, output_gradient=cotangent
    )
    variables = layer.canonical_variables()
    names = sorted(variables)
    for _ in range(2):  # (the first call traces the program, the second runs it)
        x_native = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x_native)
            output = layer(x_native, x_native, x_native, causal=True)
        grads = tape.gradient(
            output,
            [x_native, *(variables[name] for name in names)],
            output_gradients=tf.constant(cotangent),
        )
        inputs = expected["queries"] + expected["keys"] + expected["values"]
        np.testing.assert_allclose(grads[0].numpy(), inputs, atol=GRADIENT, rtol=0)
        for name, grad in zip(names, grads[1:], strict=True):
            np.testing.assert_allclose(grad.numpy(), expected[name], atol=GRADIENT, rtol=0)
    assert len(traces) == 1
