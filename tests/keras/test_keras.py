"""What only the Keras backend has: lazy build, serialization, the functional API,
compilation, mixed precision and training, on whichever Keras backend is active."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from conftest import gpu_required  # noqa: E402
from mha_multi import spec  # noqa: E402
from mha_multi.keras import MultiHeadAttention, get_weights, set_weights  # noqa: E402
from mha_multi.keras._ops import to_numpy  # noqa: E402
from mha_multi.parity.cases import CASES, build_case  # noqa: E402
from mha_multi.weights import init_weights  # noqa: E402

BACKEND = keras.backend.backend()

# Keras' own numpy conversions (Layer.get_weights, predict...) call np.array on
# framework arrays whose __array__ predates numpy 2's copy keyword.
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)
RNG = np.random.default_rng(1)


def case_named(name):
    return build_case(next(c for c in CASES if c.name == name))


def layer_for(case, **kwargs):
    # The weights are loaded at once: no random initialisation, which on the
    # JAX backend compiles anew for every shape.
    kwargs.setdefault("kernel_initializer", "zeros")
    layer = MultiHeadAttention(
        case.config.num_hiddens, case.config.num_heads, bias=case.config.bias, **kwargs
    )
    return set_weights(layer, case.weights)


def arrays(case):
    return [case.inputs[name] for name in ("queries", "keys", "values")]


def numpy(x):
    return to_numpy(x).astype(np.float64)


@pytest.fixture
def policy():
    """Sets a global dtype policy for one test and restores the previous one."""
    previous = keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy(previous)


# -- the layer as a Keras layer ----------------------------------------------


def test_lazy_sizes_are_inferred_on_first_call():
    layer = MultiHeadAttention(12, 3)
    assert not layer.built
    with pytest.raises(ValueError, match="query_size, key_size, value_size not known yet"):
        get_weights(layer)
    q, k, v = (RNG.standard_normal(s).astype(np.float32) for s in ((2, 3, 7), (2, 5, 4), (2, 5, 6)))
    assert tuple(layer(q, k, v).shape) == (2, 3, 12)
    assert layer.built
    assert layer.input_sizes() == {"query_size": 7, "key_size": 4, "value_size": 6}
    assert get_weights(layer)["W_v"].shape == (6, 12)
    with pytest.raises(ValueError, match="queries last dimension must be query_size=7"):
        layer(RNG.standard_normal((2, 3, 8)).astype(np.float32), k, v)


def test_lazy_build_checks_shapes_before_creating_variables():
    layer = MultiHeadAttention(8, 2)
    q = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="keys and values must have the same length"):
        layer(q, q[:, :2], q)
    assert layer.input_sizes() == {"query_size": None, "key_size": None, "value_size": None}


def test_sizes_given_up_front_build_at_construction():
    layer = MultiHeadAttention(12, 3, bias=True, query_size=7, key_size=5, value_size=3)
    assert layer.built
    assert {v.path.split("/")[-1]: tuple(v.shape) for v in layer.weights} == {
        "W_q": (7, 12),
        "W_k": (5, 12),
        "W_v": (3, 12),
        "W_o": (12, 12),
        "b_q": (12,),
        "b_k": (12,),
        "b_v": (12,),
        "b_o": (12,),
    }


def test_set_weights_fixes_lazy_sizes_and_matches_reference():
    case = case_named("cross_sizes")
    layer = layer_for(case)
    assert layer.input_sizes() == {"query_size": 7, "key_size": 5, "value_size": 3}
    out = layer(*arrays(case), case.valid_lens)
    np.testing.assert_allclose(numpy(out), case.reference["output"], atol=5e-6)


def test_variables_are_the_canonical_weights():
    case = case_named("bias")
    layer = layer_for(case)
    for name, array in case.weights.items():
        np.testing.assert_array_equal(to_numpy(getattr(layer, name).value), array)


def test_keras_list_weights_api_still_works():
    case = case_named("bias")
    source = layer_for(case)
    target = MultiHeadAttention(16, 4, bias=True, query_size=16, key_size=16, value_size=16)
    target.set_weights(source.get_weights())  # Keras' own list-based methods
    for name, array in get_weights(target).items():
        np.testing.assert_array_equal(array, case.weights[name])


def test_initialization_is_keras_dense_default():
    layer = MultiHeadAttention(64, 4, bias=True, query_size=32, key_size=32, value_size=32)
    weights = get_weights(layer)
    limit = np.sqrt(6 / (32 + 64))  # glorot_uniform
    assert np.abs(weights["W_q"]).max() <= limit
    assert np.abs(weights["W_q"]).max() > 0.8 * limit
    np.testing.assert_array_equal(weights["b_o"], 0.0)


def test_valid_lens_accepts_lists_numpy_and_tensors():
    case = case_named("lens_1d")
    layer = layer_for(case)
    expected = case.reference["output"]
    lens_tensor = keras.ops.convert_to_tensor(case.valid_lens)
    for valid_lens in (case.valid_lens.tolist(), case.valid_lens, lens_tensor):
        out = layer(*arrays(case), valid_lens)
        np.testing.assert_allclose(numpy(out), expected, atol=5e-6)
    out = layer(*arrays(case), valid_lens=case.valid_lens.tolist())
    np.testing.assert_allclose(numpy(out), expected, atol=5e-6)


def test_bad_tensor_inputs_are_clear_errors():
    layer = MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8)
    x = keras.ops.ones((2, 3, 8))
    with pytest.raises(TypeError, match="keys must be a floating-point tensor"):
        layer(x, keras.ops.ones((2, 3, 8), dtype="int32"), x)
    with pytest.raises(TypeError, match="valid_lens must be an integer or floating"):
        layer(x, x, x, keras.ops.convert_to_tensor(np.array([True, False])))
    with pytest.raises(TypeError, match="valid_lens must be an integer or floating"):
        layer(x, x, x, valid_lens=["a", "b"])
    with pytest.raises(TypeError, match="values must be a tensor or a numpy array; got list"):
        layer(x, x, values=[[[0.0] * 8] * 3] * 2)
    with pytest.raises(TypeError, match="queries must be a floating-point array"):
        layer(np.ones((2, 3, 8), np.int64), x, x)
    with pytest.raises(TypeError, match="causal must be a bool"):
        layer(x, x, x, causal=np.array([True, False]))


@pytest.mark.skipif(BACKEND != "jax", reason="jax_enable_x64 is JAX's")
def test_integer_lengths_beyond_32_bits_are_clipped_without_x64():
    import jax

    case = case_named("lens_1d")
    layer = layer_for(case)
    huge = np.array([2**62, -(2**40), 2**32 + 1], np.int64)  # 0, 0 and 1 when wrapped
    expected, _ = spec.reference_forward(
        case.weights, *arrays(case), huge, num_heads=case.config.num_heads
    )
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        out = layer(*arrays(case), huge)
    finally:
        jax.config.update("jax_enable_x64", x64)
    np.testing.assert_allclose(numpy(out), expected, atol=5e-6)


# -- serialization ------------------------------------------------------------


def test_config_round_trip():
    layer = MultiHeadAttention(
        12, 3, dropout=0.25, bias=True, key_size=5, seed=4, name="attention", dtype="float16"
    )
    config = layer.get_config()
    assert config["key_size"] == 5 and config["query_size"] is None
    clone = MultiHeadAttention.from_config(config)
    assert clone.get_config() == config
    assert clone.dtype_policy.name == "float16"
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(restored) is MultiHeadAttention
    assert restored.get_config() == config


def test_config_records_sizes_learned_from_the_first_call():
    layer = MultiHeadAttention(8, 2)
    q = RNG.standard_normal((1, 2, 3)).astype(np.float32)
    layer(q, q, q)
    clone = MultiHeadAttention.from_config(layer.get_config())
    assert clone.built
    assert clone.input_sizes() == {"query_size": 3, "key_size": 3, "value_size": 3}


def functional_model(layer, case, *, lens_dtype="int32", weights_output=False):
    config = case.config
    sizes = config.sizes()
    queries = keras.Input((config.num_queries, sizes["query_size"]), name="queries")
    keys = keras.Input((config.num_keys, sizes["key_size"]), name="keys")
    values = keras.Input((config.num_keys, sizes["value_size"]), name="values")
    lens_shape = case.valid_lens.shape[1:]
    valid_lens = keras.Input(lens_shape, dtype=lens_dtype, name="valid_lens")
    outputs = layer(
        queries,
        keys,
        values,
        valid_lens,
        causal=config.causal,
        return_attention_weights=weights_output,
    )
    return keras.Model([queries, keys, values, valid_lens], outputs)


@pytest.mark.parametrize("name", ["book", "causal_lens_2d", "cross_sizes"])
def test_functional_model_matches_reference(name):
    case = case_named(name)
    layer = layer_for(case)
    model = functional_model(layer, case, weights_output=True)
    assert tuple(model.outputs[0].shape) == (None, case.config.num_queries, case.config.num_hiddens)
    assert tuple(model.outputs[1].shape) == (
        None,
        case.config.num_heads,
        case.config.num_queries,
        case.config.num_keys,
    )
    output, weights = model([*arrays(case), case.valid_lens.astype(np.int32)])
    np.testing.assert_allclose(numpy(output), case.reference["output"], atol=5e-6)
    np.testing.assert_allclose(numpy(weights), case.reference["attention_weights"], atol=5e-6)
    predicted = model.predict([*arrays(case), case.valid_lens.astype(np.int32)], verbose=0)
    np.testing.assert_allclose(predicted[0], case.reference["output"], atol=5e-6)


def test_functional_model_with_float_lens():
    case = case_named("lens_1d_float")
    model = functional_model(layer_for(case), case, lens_dtype="float32")
    output = model([*arrays(case), case.valid_lens])
    np.testing.assert_allclose(numpy(output), case.reference["output"], atol=5e-6)


def test_functional_api_rejects_bad_shapes_and_dtypes():
    layer = MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8)
    q, kv = keras.Input((3, 8)), keras.Input((4, 8))
    with pytest.raises(ValueError, match="queries last dimension must be query_size=8"):
        layer(keras.Input((3, 5)), kv, kv)
    with pytest.raises(ValueError, match="valid_lens must have shape"):
        layer(q, kv, kv, keras.Input((4,), dtype="int32"))
    with pytest.raises(TypeError, match="valid_lens must be an integer or floating"):
        layer(q, kv, kv, keras.Input((), dtype="bool"))


@pytest.mark.parametrize("sizes", ["given", "lazy", "key_size_only"])
def test_saved_model_loads_with_identical_outputs(tmp_path, sizes):
    case = case_named("cross_sizes")
    kwargs = {
        "given": case.config.sizes(),
        "lazy": {},
        # The key projection is created before the query projection here.
        "key_size_only": {"key_size": case.config.sizes()["key_size"]},
    }[sizes]
    layer = MultiHeadAttention(
        case.config.num_hiddens, case.config.num_heads, bias=True, dropout=0.1, **kwargs
    )
    model = functional_model(layer, case)
    set_weights(layer, case.weights)
    inputs = [*arrays(case), case.valid_lens.astype(np.int32)]
    expected = numpy(model(inputs))
    np.testing.assert_allclose(expected, case.reference["output"], atol=5e-6)

    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded_layer = next(lyr for lyr in loaded.layers if isinstance(lyr, MultiHeadAttention))
    np.testing.assert_array_equal(numpy(loaded(inputs)), expected)
    for name, array in get_weights(loaded_layer).items():
        np.testing.assert_array_equal(array, case.weights[name])
    assert loaded_layer.get_config() == layer.get_config()


# -- compilation --------------------------------------------------------------


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function is TensorFlow's")
@pytest.mark.parametrize("name", ["book", "causal_cross", "lens_2d", "lens_1d_float"])
def test_tf_function_jit_compile_matches_reference(name):
    import tensorflow as tf

    case = case_named(name)
    layer = layer_for(case)

    @tf.function(jit_compile=True)
    def attend(q, k, v, lens):
        return layer(q, k, v, lens, causal=case.config.causal, return_attention_weights=True)

    out, weights = attend(*arrays(case), tf.constant(case.valid_lens))
    np.testing.assert_allclose(out.numpy(), case.reference["output"], atol=5e-6)
    np.testing.assert_allclose(weights.numpy(), case.reference["attention_weights"], atol=5e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function is TensorFlow's")
def test_tf_function_with_unknown_batch_and_lengths():
    import tensorflow as tf

    case = case_named("lens_2d")
    layer = layer_for(case)
    spec_3d = tf.TensorSpec((None, None, 16), tf.float32)
    attend = tf.function(
        lambda q, k, v, lens: layer(q, k, v, lens),
        input_signature=[spec_3d, spec_3d, spec_3d, tf.TensorSpec((None, None), tf.int64)],
    )
    out = attend(*arrays(case), tf.constant(case.valid_lens))
    np.testing.assert_allclose(out.numpy(), case.reference["output"], atol=5e-6)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit is JAX's")
def test_jax_jit_of_stateless_call_matches_reference():
    import jax

    case = case_named("causal_lens_2d")
    layer = layer_for(case)

    @jax.jit
    def attend(trainable, non_trainable, q, k, v, lens):
        (out, weights), _ = layer.stateless_call(
            trainable, non_trainable, q, k, v, lens, causal=True, return_attention_weights=True
        )
        return out, weights

    out, weights = attend(
        [v.value for v in layer.trainable_variables],
        [v.value for v in layer.non_trainable_variables],
        *arrays(case),
        case.valid_lens,
    )
    np.testing.assert_allclose(np.asarray(out), case.reference["output"], atol=5e-6)
    np.testing.assert_allclose(np.asarray(weights), case.reference["attention_weights"], atol=5e-6)


# -- mixed precision ------------------------------------------------------------


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_keeps_float32_variables(policy, policy_name):
    policy(policy_name)
    compute = policy_name.removeprefix("mixed_")
    layer = MultiHeadAttention(8, 2, bias=True, query_size=8, key_size=8, value_size=8)
    assert layer.compute_dtype == compute and layer.variable_dtype == "float32"
    assert {v.dtype for v in layer.weights} == {"float32"}
    weights = init_weights(8, bias=True, seed=3)
    set_weights(layer, weights)
    q, k, v = (RNG.standard_normal(s).astype(np.float32) for s in ((2, 3, 8), (2, 4, 8), (2, 4, 8)))
    lens = np.array([0, 2])  # a fully hidden row: -1e6 overflows float16
    out, attention = layer(q, k, v, lens, return_attention_weights=True)
    assert keras.backend.standardize_dtype(out.dtype) == compute
    assert keras.backend.standardize_dtype(attention.dtype) == compute
    assert np.all(np.isfinite(numpy(out)))
    expected, expected_weights = spec.reference_forward(weights, q, k, v, lens, num_heads=2)
    np.testing.assert_allclose(numpy(out), expected, atol=2e-2)
    np.testing.assert_allclose(numpy(attention), expected_weights, atol=2e-2)
    for name, array in get_weights(layer).items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, weights[name])


def test_mixed_precision_does_not_round_float_lengths(policy):
    # bfloat16 spaces numbers 2 apart at 256: a length of 256.5 would become
    # 256 and hide key 256, which 256.5 shows.
    policy("mixed_bfloat16")
    layer = MultiHeadAttention(4, 1, query_size=4, key_size=4, value_size=4)
    q = RNG.standard_normal((1, 1, 4)).astype(np.float32)
    kv = np.zeros((1, 258, 4), np.float32)
    _, attention = layer(q, kv, kv, np.array([256.5], np.float32), return_attention_weights=True)
    weights = numpy(attention)[0, 0, 0]
    np.testing.assert_allclose(weights[:257], 1 / 257, rtol=1e-2)
    assert weights[257] == 0.0


# -- training -----------------------------------------------------------------


def test_dropout_is_seeded_and_only_in_training():
    make = lambda: MultiHeadAttention(  # noqa: E731
        16, 2, dropout=0.5, seed=7, query_size=16, key_size=16, value_size=16
    )
    weights = init_weights(16, seed=5)
    first, second = (set_weights(make(), weights) for _ in range(2))
    q = RNG.standard_normal((2, 6, 16)).astype(np.float32)
    a, b = (numpy(layer(q, q, q, training=True)) for layer in (first, second))
    np.testing.assert_array_equal(a, b)  # same seed, same masks
    expected, _ = spec.reference_forward(weights, q, q, q, num_heads=2)
    assert np.abs(a - expected).max() > 1e-3
    np.testing.assert_allclose(numpy(first(q, q, q)), expected, atol=5e-6)
    np.testing.assert_allclose(numpy(first(q, q, q, training=False)), expected, atol=5e-6)


def test_fit_reduces_the_loss():
    keras.utils.set_random_seed(0)
    case = case_named("book")
    layer = MultiHeadAttention(16, 4, dropout=0.1, query_size=16, key_size=16, value_size=16)
    queries = keras.Input((4, 16))
    keys = keras.Input((6, 16))
    valid_lens = keras.Input((), dtype="int32")
    model = keras.Model(
        [queries, keys, valid_lens], layer(queries, keys, keys, valid_lens, causal=True)
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    rng = np.random.default_rng(case.config.seed)
    x = [
        rng.standard_normal((32, 4, 16)).astype(np.float32),
        rng.standard_normal((32, 6, 16)).astype(np.float32),
        rng.integers(0, 7, 32).astype(np.int32),
    ]
    y = rng.standard_normal((32, 4, 16)).astype(np.float32) * 0.1
    history = model.fit(x, y, epochs=8, batch_size=8, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.8 * losses[0]


# -- devices ------------------------------------------------------------------


@pytest.fixture
def gpu(runner):
    if not runner.device_available("gpu"):
        if gpu_required():
            pytest.fail("no GPU, and MHA_MULTI_REQUIRE_GPU is set")
        pytest.skip("no GPU")
    return "gpu"


@pytest.fixture
def runner():
    from mha_multi.parity.runners import get_runner

    return get_runner(f"keras-{BACKEND}")


def test_gpu_weights_round_trip_and_reference(gpu):
    case = case_named("lens_2d")
    with keras.device(gpu):
        layer = layer_for(case)
        out = layer(*arrays(case), case.valid_lens)
    np.testing.assert_allclose(numpy(out), case.reference["output"], atol=5e-6)
    got = get_weights(layer)
    assert all(got[k].tobytes() == case.weights[k].tobytes() for k in case.weights)
