"""What only the Keras backend has: lazy build, serialization, the functional API,
compilation, mixed precision and training, on whichever Keras backend is active."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from keras_testing import COPY_KEYWORD_WARNING, inputs, keras_runner  # noqa: E402, F401
from option_cases import sink_past_float16  # noqa: E402

from mha_multi import spec  # noqa: E402
from mha_multi.interop.keras import to_keras_gqa, to_keras_mha  # noqa: E402
from mha_multi.keras import MultiHeadAttention, get_weights, set_weights  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402
from mha_multi.weights import init_weights  # noqa: E402

pytestmark = COPY_KEYWORD_WARNING


@pytest.fixture
def policy():
    """Sets a global dtype policy for one test and restores the previous one."""
    previous = keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy(previous)


# -- the layer as a Keras layer ----------------------------------------------


def test_lazy_sizes_are_inferred_on_first_call():
    rng = np.random.default_rng(1)
    layer = MultiHeadAttention(12, 3)
    assert not layer.built
    with pytest.raises(ValueError, match="query_size, key_size, value_size not known yet"):
        get_weights(layer)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 7), (2, 5, 4), (2, 5, 6)))
    assert tuple(layer(q, k, v).shape) == (2, 3, 12)
    assert layer.built
    assert layer.input_sizes() == {"query_size": 7, "key_size": 4, "value_size": 6}
    assert get_weights(layer)["W_v"].shape == (6, 12)
    with pytest.raises(ValueError, match="queries last dimension must be query_size=7"):
        layer(rng.standard_normal((2, 3, 8)).astype(np.float32), k, v)


def test_lazy_build_checks_shapes_before_creating_variables():
    rng = np.random.default_rng(2)
    layer = MultiHeadAttention(8, 2)
    q = rng.standard_normal((2, 3, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="keys and values must have the same length"):
        layer(q, q[:, :2], q)
    assert layer.input_sizes() == {"query_size": None, "key_size": None, "value_size": None}


def test_sizes_given_up_front_build_at_construction():
    layer = MultiHeadAttention(12, 3, bias=True, query_size=7, key_size=5, value_size=3)
    assert layer.built
    kernels = {"W_q": (7, 12), "W_k": (5, 12), "W_v": (3, 12), "W_o": (12, 12)}
    biases = {"b_q": (12,), "b_k": (12,), "b_v": (12,), "b_o": (12,)}
    assert {v.path.split("/")[-1]: tuple(v.shape) for v in layer.weights} == {**kernels, **biases}


def test_set_weights_fixes_lazy_sizes_and_matches_reference(runner, cases):
    case = cases["cross_sizes"]
    layer = runner.layer_for(case)
    assert layer.input_sizes() == {"query_size": 7, "key_size": 5, "value_size": 3}
    out = layer(*inputs(case), case.valid_lens)
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=5e-6)


def test_variables_are_the_canonical_weights(runner, cases):
    case = cases["bias"]
    layer = runner.layer_for(case)
    for name, array in case.weights.items():
        np.testing.assert_array_equal(backend.as_numpy(getattr(layer, name).value), array)


def test_keras_list_weights_api_still_works(runner, cases):
    case = cases["bias"]
    source = runner.layer_for(case)
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


def test_valid_lens_by_keyword_may_be_a_list(runner, cases):
    """Keras converts arguments before ``call``; the layer's ``__call__`` converts a list first."""
    case = cases["lens_1d"]
    layer = runner.layer_for(case)
    out = layer(*inputs(case), valid_lens=case.valid_lens.tolist())
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=5e-6)


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


def test_a_training_flag_that_is_no_bool_is_refused():
    """``training="False"`` is truthy: it turned dropout on."""
    layer = MultiHeadAttention(8, 2, dropout=0.5)
    x = keras.ops.ones((2, 3, 8))
    with pytest.raises(TypeError, match="training must be a bool; got 'False'"):
        layer(x, x, x, training="False")


@pytest.mark.skipif(backend.BACKEND != "jax", reason="jax_enable_x64 is JAX's")
def test_a_float64_layer_or_cache_without_x64_is_refused_not_computed_in_float32():
    """Keras on JAX without x64 holds float64 as float32: a float64 layer's variables
    said float64 while its outputs were float32. With x64, float64 throughout."""
    import jax

    x64 = jax.config.jax_enable_x64
    try:
        jax.config.update("jax_enable_x64", False)
        with pytest.raises(ValueError, match="^dtype float64: Keras' jax backend holds float64"):
            MultiHeadAttention(8, 2, dtype="float64")
        with pytest.raises(ValueError, match="^dtype float64: Keras' jax backend holds float64"):
            MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8).init_cache(
                1, 4, dtype="float64"
            )
        weights = init_weights(8, num_heads=2, seed=0)
        for convert in (to_keras_mha, lambda w, h, **kw: to_keras_gqa(w, num_heads=h, **kw)):
            with pytest.raises(ValueError, match="^dtype float64: Keras' jax backend holds"):
                convert(weights, 2, dtype="float64")
        jax.config.update("jax_enable_x64", True)
        layer = MultiHeadAttention(8, 2, dtype="float64")
        x = np.ones((1, 3, 8))
        assert keras.backend.standardize_dtype(layer(x, x, x).dtype) == "float64"
    finally:
        jax.config.update("jax_enable_x64", x64)


@pytest.mark.skipif(backend.BACKEND != "jax", reason="jax_enable_x64 is JAX's")
def test_integer_lengths_beyond_32_bits_are_clipped_without_x64(runner, cases):
    import jax

    case = cases["lens_1d"]
    layer = runner.layer_for(case)
    huge = np.array([2**62, -(2**40), 2**32 + 1], np.int64)  # 0, 0 and 1 when wrapped
    expected, _ = spec.reference_forward(
        case.weights, *inputs(case), huge, num_heads=case.config.num_heads
    )
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        out = layer(*inputs(case), huge)
    finally:
        jax.config.update("jax_enable_x64", x64)
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "jax", reason="jax_enable_x64 is JAX's")
def test_positions_beyond_32_bits_without_x64_are_refused_not_wrapped(runner):
    """Keras on JAX without x64 holds int64 positions as int32 (``2**32 + 2`` as 2): numpy
    positions past int32 are refused naming them, those within it rotate as the
    reference rotates them."""
    import jax

    rotary = {"theta": 100.0}
    weights = init_weights(8, num_heads=2, seed=3)
    queries = np.random.default_rng(3).standard_normal((2, 3, 8)).astype(np.float32)
    layer = runner.set_weights(runner.make_layer(8, 2, rotary=rotary), weights)
    within = np.array([[0, 1, 70000], [3, -9, 5]])
    expected, _ = spec.reference_forward(
        weights, *[queries] * 3, num_heads=2, rotary=rotary, positions=within
    )
    x = keras.ops.convert_to_tensor(queries)
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(ValueError, match="^positions must fit in int32, the integers"):
            layer(x, x, x, positions=np.array([[0, 1, 2**32 + 2], [3, 4, 5]]))
        out = layer(x, x, x, positions=within)
    finally:
        jax.config.update("jax_enable_x64", x64)
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "jax", reason="jax_enable_x64 is JAX's")
def test_float64_lengths_without_x64_show_the_keys_they_show(runner, cases):
    import jax

    case = cases["lens_1d"]
    layer = runner.layer_for(case)
    tiny = np.array([5e-324, 2 + 1e-9, -1e-300])  # rounded to float32: 0, 2 and -0
    expected, _ = spec.reference_forward(
        case.weights, *inputs(case), tiny, num_heads=case.config.num_heads
    )
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        out = layer(*inputs(case), tiny)
    finally:
        jax.config.update("jax_enable_x64", x64)
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=5e-6)


def _uint64_tensor(values: list[int]):
    """``values`` as the active backend's own uint64 tensor (JAX: under x64)."""
    if backend.BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.constant(values, tf.uint64)
    if backend.BACKEND == "torch":
        import torch

        return torch.tensor(values, dtype=torch.uint64)
    import jax.numpy as jnp

    return jnp.asarray(np.array(values, np.uint64))


@pytest.mark.parametrize("fused", [True, False])
def test_uint64_length_tensors_are_clipped_never_wrapped(runner, cases, fused):
    """A framework's own uint64 lengths past int64's range hide nothing, as numpy's do
    (TensorFlow compared them wrapped, PyTorch compared none)."""
    case = cases["lens_1d"]
    layer = runner.layer_for(case)
    queries, keys, values = inputs(case)
    lens = [2**63 + 5, 2**64 - 1, 2]  # as int64: negative, -1, 2
    expected, _ = spec.reference_forward(
        case.weights,
        queries,
        keys,
        values,
        np.array(lens, np.uint64),
        num_heads=case.config.num_heads,
    )
    x64 = None
    if backend.BACKEND == "jax":  # (JAX has no uint64 arrays without x64)
        import jax

        x64 = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)
    try:
        out = layer(queries, keys, values, _uint64_tensor(lens), return_attention_weights=not fused)
    finally:
        if x64 is not None:
            jax.config.update("jax_enable_x64", x64)
    out = out if fused else out[0]
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=5e-6)


def test_a_numpy_bool_is_a_causal_flag(runner, cases):
    """As every other backend takes it: Keras would make it a tensor, which no flag is."""
    case = cases["book"]
    layer = runner.layer_for(case)
    expected, _ = spec.reference_forward(
        case.weights, *inputs(case), num_heads=case.config.num_heads, causal=True
    )
    out = layer(*inputs(case), causal=np.bool_(True))
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=5e-6)


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


def test_grouped_config_round_trip():
    layer = MultiHeadAttention(10, 4, num_kv_heads=2, head_dim=3, bias=True, key_size=5)
    config = layer.get_config()
    assert (config["num_kv_heads"], config["head_dim"]) == (2, 3)
    clone = MultiHeadAttention.from_config(config)
    assert clone.get_config() == config
    assert (clone.num_kv_heads, clone.head_dim) == (2, 3)
    assert {name: tuple(v.shape) for name, v in clone.canonical_variables().items()} == {
        "W_k": (5, 6),
        "b_k": (6,),
        "W_o": (12, 10),
        "b_o": (10,),
    }
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert restored.get_config() == config


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "longrope",
            "short_factor": [1.0, 2.0],
            "long_factor": [3.0, 4.0],
            "original_max_position_embeddings": 8,
            "factor": 2.0,
        },
    ],
)
def test_a_rotary_type_round_trips_through_the_config(scaling):
    layer = MultiHeadAttention(8, 2, rotary={"theta": 50.0, "scaling": scaling})
    config = layer.get_config()
    assert config["rotary"]["scaling"]["rope_type"] == scaling["rope_type"]
    assert MultiHeadAttention.from_config(config).options == layer.options
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert restored.get_config() == config and restored.options == layer.options


def test_qk_norm_config_and_variables_round_trip():
    norm = {"scope": "whole", "eps": 1e-5, "unit_offset": True, "product": "float32"}
    layer = MultiHeadAttention(8, 2, qk_norm=norm, query_size=8, key_size=8, value_size=8)
    config = layer.get_config()
    assert config["qk_norm"] == norm
    clone = MultiHeadAttention.from_config(config)
    assert clone.get_config() == config
    store = {}
    layer.q_norm.assign(np.arange(8, dtype=np.float32))
    layer.save_own_variables(store)
    assert {"q_norm", "k_norm"} <= set(store)
    clone.load_own_variables(store)
    np.testing.assert_array_equal(backend.to_numpy(clone.q_norm.value), np.arange(8))


def test_config_without_head_options_is_multi_head_attention():
    # What get_config recorded before num_kv_heads and head_dim existed.
    config = MultiHeadAttention(12, 3).get_config()
    assert (config.pop("num_kv_heads"), config.pop("head_dim")) == (3, 4)
    layer = MultiHeadAttention.from_config(config)
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (3, 3, 4)


def test_grouped_lazy_sizes_are_inferred_on_first_call():
    rng = np.random.default_rng(4)
    layer = MultiHeadAttention(10, 4, num_kv_heads=2, head_dim=3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 7), (2, 5, 4), (2, 5, 6)))
    out, weights = layer(q, k, v, return_attention_weights=True)
    assert tuple(out.shape) == (2, 3, 10) and tuple(weights.shape) == (2, 4, 3, 5)
    assert {name: a.shape for name, a in get_weights(layer).items()} == {
        "W_q": (7, 12),
        "W_k": (4, 6),
        "W_v": (6, 6),
        "W_o": (12, 10),
    }


def test_config_records_sizes_learned_from_the_first_call():
    rng = np.random.default_rng(3)
    layer = MultiHeadAttention(8, 2)
    q = rng.standard_normal((1, 2, 3)).astype(np.float32)
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


@pytest.mark.parametrize("name", ["book", "causal_lens_2d", "cross_sizes", "gqa", "head_dim"])
def test_functional_model_matches_reference(runner, cases, name):
    case = cases[name]
    layer = runner.layer_for(case)
    model = functional_model(layer, case, weights_output=True)
    assert tuple(model.outputs[0].shape) == (None, case.config.num_queries, case.config.num_hiddens)
    assert tuple(model.outputs[1].shape) == (
        None,
        case.config.num_heads,
        case.config.num_queries,
        case.config.num_keys,
    )
    output, weights = model([*inputs(case), case.valid_lens.astype(np.int32)])
    np.testing.assert_allclose(backend.to_numpy(output), case.reference["output"], atol=5e-6)
    np.testing.assert_allclose(
        backend.to_numpy(weights), case.reference["attention_weights"], atol=5e-6
    )
    predicted = model.predict([*inputs(case), case.valid_lens.astype(np.int32)], verbose=0)
    np.testing.assert_allclose(predicted[0], case.reference["output"], atol=5e-6)


def test_functional_model_with_float_lens(runner, cases):
    case = cases["lens_1d_float"]
    model = functional_model(runner.layer_for(case), case, lens_dtype="float32")
    output = model([*inputs(case), case.valid_lens])
    np.testing.assert_allclose(backend.to_numpy(output), case.reference["output"], atol=5e-6)


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
def test_saved_model_loads_with_identical_outputs(cases, tmp_path, sizes):
    case = cases["cross_sizes"]
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
    arguments = [*inputs(case), case.valid_lens.astype(np.int32)]
    expected = backend.to_numpy(model(arguments))
    np.testing.assert_allclose(expected, case.reference["output"], atol=5e-6)

    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded_layer = next(lyr for lyr in loaded.layers if isinstance(lyr, MultiHeadAttention))
    np.testing.assert_array_equal(backend.to_numpy(loaded(arguments)), expected)
    for name, array in get_weights(loaded_layer).items():
        np.testing.assert_array_equal(array, case.weights[name])
    assert loaded_layer.get_config() == layer.get_config()


@pytest.mark.parametrize(
    ("name", "kv_heads_and_dim"),
    [
        ("head_dim", (2, 3)),  # 2 of 4 key/value heads of size 3, 10 hiddens
        ("sinks", (2, 4)),  # 2 of 8 key/value heads, a window and sink logits
    ],
)
def test_grouped_saved_model_loads_with_identical_outputs(cases, tmp_path, name, kv_heads_and_dim):
    case = cases[name]
    config = case.config
    options = config.layer_options()
    layer = MultiHeadAttention(
        config.num_hiddens, config.num_heads, bias=config.bias, **config.heads(), **options
    )
    clone = MultiHeadAttention.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    assert clone.options == layer.options and layer.options.sinks == bool(options.get("sinks"))
    model = functional_model(layer, case)
    set_weights(layer, case.weights)
    arguments = [*inputs(case), case.valid_lens.astype(np.int32)]
    expected = backend.to_numpy(model(arguments))
    np.testing.assert_allclose(expected, case.reference["output"], rtol=0, atol=5e-6)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded_layer = next(lyr for lyr in loaded.layers if isinstance(lyr, MultiHeadAttention))
    assert (loaded_layer.num_kv_heads, loaded_layer.head_dim) == kv_heads_and_dim
    assert loaded_layer.get_config() == layer.get_config()
    np.testing.assert_array_equal(backend.to_numpy(loaded(arguments)), expected)
    for name, array in get_weights(loaded_layer).items():
        np.testing.assert_array_equal(array, case.weights[name])


# -- compilation --------------------------------------------------------------


@pytest.mark.skipif(backend.BACKEND != "tensorflow", reason="tf.function is TensorFlow's")
@pytest.mark.parametrize("name", ["book", "causal_cross", "lens_2d", "lens_1d_float"])
def test_tf_function_jit_compile_matches_reference(runner, cases, name):
    import tensorflow as tf

    case = cases[name]
    layer = runner.layer_for(case)

    @tf.function(jit_compile=True)
    def attend(q, k, v, lens):
        return layer(q, k, v, lens, causal=case.config.causal, return_attention_weights=True)

    out, weights = attend(*inputs(case), backend.lens_to_native(case.valid_lens))
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=5e-6)
    np.testing.assert_allclose(
        backend.to_numpy(weights), case.reference["attention_weights"], atol=5e-6
    )


@pytest.mark.skipif(backend.BACKEND != "tensorflow", reason="tf.function is TensorFlow's")
@pytest.mark.parametrize("jit_compile", [False, True])
def test_tf_function_lengths_nan_infinite_or_subnormal_mean_what_they_say(jit_compile):
    """A NaN length hides every key, a subnormal one shows key 0, in a graph too (whose
    optimizer rewrites not(j < len) as j >= len, false for NaN)."""
    import tensorflow as tf

    weights = init_weights(8, num_heads=2, seed=5)
    layer = MultiHeadAttention(8, 2)
    set_weights(layer, weights)
    x = np.random.default_rng(5).standard_normal((2, 3, 8)).astype(np.float32)
    attend = tf.function(
        lambda x, lens: layer(x, x, x, lens, return_attention_weights=True),
        jit_compile=jit_compile,
    )
    for lens in (
        np.array([[np.nan, 1, 2], [0, np.inf, -np.inf]], np.float32),
        np.array([[1e-45, 1e-40, -1e-45], [0.0, np.nan, 1e-38]], np.float32),
    ):
        expected, expected_weights = spec.reference_forward(weights, x, x, x, lens, num_heads=2)
        output, got_weights = attend(tf.constant(x), tf.constant(lens))
        np.testing.assert_allclose(backend.to_numpy(output), expected, atol=5e-6)
        np.testing.assert_allclose(backend.to_numpy(got_weights), expected_weights, atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "tensorflow", reason="tf.function is TensorFlow's")
def test_tf_function_with_unknown_batch_and_lengths(runner, cases):
    import tensorflow as tf

    case = cases["lens_2d"]
    layer = runner.layer_for(case)
    spec_3d = tf.TensorSpec((None, None, 16), tf.float32)
    attend = tf.function(
        lambda q, k, v, lens: layer(q, k, v, lens),
        input_signature=[spec_3d, spec_3d, spec_3d, tf.TensorSpec((None, None), tf.int64)],
    )
    out = attend(*inputs(case), backend.lens_to_native(case.valid_lens))
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "jax", reason="jax.jit is JAX's")
def test_jax_jit_of_stateless_call_matches_reference(runner, cases):
    import jax

    case = cases["causal_lens_2d"]
    layer = runner.layer_for(case)

    @jax.jit
    def attend(values, q, k, v, lens):
        (out, weights), _ = layer.stateless_call(
            *values, q, k, v, lens, causal=True, return_attention_weights=True
        )
        return out, weights

    out, weights = attend(backend.state(layer), *inputs(case), case.valid_lens)
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=5e-6)
    np.testing.assert_allclose(
        backend.to_numpy(weights), case.reference["attention_weights"], atol=5e-6
    )


# -- mixed precision ------------------------------------------------------------


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_keeps_float32_variables(policy, policy_name):
    rng = np.random.default_rng(4)
    policy(policy_name)
    compute = policy_name.removeprefix("mixed_")
    layer = MultiHeadAttention(8, 2, bias=True, query_size=8, key_size=8, value_size=8)
    assert layer.compute_dtype == compute and layer.variable_dtype == "float32"
    assert {v.dtype for v in layer.weights} == {"float32"}
    weights = init_weights(8, bias=True, seed=3)
    set_weights(layer, weights)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 8), (2, 4, 8), (2, 4, 8)))
    lens = np.array([0, 2])  # a fully hidden row: -1e6 overflows float16
    out, attention = layer(q, k, v, lens, return_attention_weights=True)
    assert keras.backend.standardize_dtype(out.dtype) == compute
    assert keras.backend.standardize_dtype(attention.dtype) == compute
    assert np.all(np.isfinite(backend.to_numpy(out)))
    expected, expected_weights = spec.reference_forward(weights, q, k, v, lens, num_heads=2)
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=2e-2)
    np.testing.assert_allclose(backend.to_numpy(attention), expected_weights, atol=2e-2)
    for name, array in get_weights(layer).items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, weights[name])


def test_mixed_precision_does_not_round_float_lengths(policy):
    rng = np.random.default_rng(5)
    # bfloat16 spaces numbers 2 apart at 256: a length of 256.5 would become
    # 256 and hide key 256, which 256.5 shows.
    policy("mixed_bfloat16")
    layer = MultiHeadAttention(4, 1, query_size=4, key_size=4, value_size=4)
    q = rng.standard_normal((1, 1, 4)).astype(np.float32)
    kv = np.zeros((1, 258, 4), np.float32)
    _, attention = layer(q, kv, kv, np.array([256.5], np.float32), return_attention_weights=True)
    weights = backend.to_numpy(attention)[0, 0, 0]
    np.testing.assert_allclose(weights[:257], 1 / 257, rtol=1e-2)
    assert weights[257] == 0.0


# -- training -----------------------------------------------------------------


def test_dropout_is_seeded_and_only_in_training():
    rng = np.random.default_rng(6)
    make = lambda: MultiHeadAttention(  # noqa: E731
        16, 2, dropout=0.5, seed=7, query_size=16, key_size=16, value_size=16
    )
    weights = init_weights(16, seed=5)
    first, second = (set_weights(make(), weights) for _ in range(2))
    q = rng.standard_normal((2, 6, 16)).astype(np.float32)
    a, b = (backend.to_numpy(layer(q, q, q, training=True)) for layer in (first, second))
    np.testing.assert_array_equal(a, b)  # same seed, same masks
    expected, _ = spec.reference_forward(weights, q, q, q, num_heads=2)
    assert np.abs(a - expected).max() > 1e-3
    np.testing.assert_allclose(backend.to_numpy(first(q, q, q)), expected, atol=5e-6)
    np.testing.assert_allclose(
        backend.to_numpy(first(q, q, q, training=False)), expected, atol=5e-6
    )


def test_fit_reduces_the_loss(cases):
    keras.utils.set_random_seed(0)
    case = cases["book"]
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


def test_weights_round_trip_and_reference_on_each_device(runner, cases, available_device):
    case = cases["lens_2d"]
    layer = runner.layer_for(case, device=available_device)
    out = runner.call(layer, *inputs(case), case.valid_lens, device=available_device)
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)
    got = get_weights(layer)
    assert all(got[k].tobytes() == case.weights[k].tobytes() for k in case.weights)


# -- the small call's own work ------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1, 16), (2, 5, 16), (3, 2, 4, 16)])
def test_the_flattened_product_is_keras_matmul_to_the_bit(shape):
    from mha_multi.keras._ops import OPS

    rng = np.random.default_rng(11)
    a = backend.to_native(rng.standard_normal(shape))
    b = backend.to_native(rng.standard_normal((shape[-1], 24)))
    ours, theirs = OPS.matmul(a, b), keras.ops.matmul(a, b)
    assert tuple(ours.shape) == tuple(theirs.shape)
    np.testing.assert_array_equal(backend.to_numpy(ours), backend.to_numpy(theirs))


@pytest.mark.parametrize("num_queries", [1, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_a_small_call_gives_the_numbers_of_keras_own_product(monkeypatch, num_queries, causal):
    # Against the float64 reference, and to the bit against keras.ops.matmul's
    # own route for (..., n, k) @ (k, m).
    import mha_multi.keras._ops as ops_module

    weights = init_weights(16, num_heads=4, seed=12)
    layer = set_weights(
        MultiHeadAttention(16, 4, query_size=16, key_size=16, value_size=16), weights
    )
    x = np.random.default_rng(12).standard_normal((1, num_queries, 16)).astype(np.float32)
    native = backend.to_native(x)
    output = backend.to_numpy(layer(native, native, native, causal=causal))
    expected, _ = spec.reference_forward(weights, x, x, x, num_heads=4, causal=causal)
    np.testing.assert_allclose(output, expected, rtol=0, atol=5e-6)
    with pytest.raises(ValueError) as raised:
        layer(native, native, backend.to_native(x[:, :, :8]))
    monkeypatch.setattr(ops_module, "_FLATTENS_TENSORDOT", False)
    np.testing.assert_array_equal(
        backend.to_numpy(layer(native, native, native, causal=causal)), output
    )
    with pytest.raises(ValueError) as again:
        layer(native, native, backend.to_native(x[:, :, :8]))
    assert str(again.value) == str(raised.value)


def test_compute_output_shape_gives_a_calls_shapes():
    """Keras' shape inference (``compute_output_shape``, which Keras' own layer has)
    gives the shapes a call returns, checked as a call checks them."""
    weights = init_weights(16, num_heads=4, seed=0)
    layer = set_weights(MultiHeadAttention(16, 4), weights)
    rng = np.random.default_rng(0)
    queries, keys = rng.standard_normal((2, 3, 16)), rng.standard_normal((2, 5, 16))
    output, attention = layer(
        *(backend.to_native(x) for x in (queries, keys, keys)), return_attention_weights=True
    )
    assert layer.compute_output_shape((2, 3, 16), (2, 5, 16)) == tuple(output.shape)
    shapes = layer.compute_output_shape(
        (2, 3, 16), (2, 5, 16), (2, 5, 16), (2,), return_attention_weights=True
    )
    assert shapes == (tuple(output.shape), tuple(attention.shape)) == ((2, 3, 16), (2, 4, 3, 5))
    assert layer.compute_output_shape((None, 3, 16), (None, None, 16)) == (None, 3, 16)
    with pytest.raises(ValueError, match="batch"):
        layer.compute_output_shape((2, 3, 16), (3, 5, 16))


def test_a_mixed_policy_takes_its_float32_sink_logits_into_the_float32_softmax():
    """``mixed_float16``: the sinks variable is float32 and the softmax of 16-bit scores
    float32 (docs: "Positions and biases"); a logit past float16's 65504 rounded to the
    computation's float16 first was ``inf``, and every output NaN. Head 0's sink takes
    all its weight: its context is 0, as the reference's."""
    weights, x, expected = sink_past_float16()
    layer = MultiHeadAttention(8, 2, sinks=True, dtype="mixed_float16")
    layer(x, x, x)  # (built)
    set_weights(layer, weights)
    assert keras.backend.standardize_dtype(layer.sinks.dtype) == "float32"
    output = backend.to_numpy(layer(x, x, x))
    np.testing.assert_allclose(output, expected, rtol=0, atol=2e-3)
