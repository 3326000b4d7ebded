"""Interop with ``keras.layers.MultiHeadAttention``, ``keras.layers.GroupQueryAttention``,
d2l's Keras layer, and ``convert keras-mha``.

Equal outputs are checked against the native layer given the same weights and
the equivalent mask, and against the float64 reference, on the active Keras
backend; the documented differences (mask polarity, top-left causal mask,
call order) are checked as differences.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from keras_testing import COPY_KEYWORD_WARNING, inputs, keras_runner  # noqa: E402, F401

from mha_multi import spec  # noqa: E402
from mha_multi.__main__ import main as cli  # noqa: E402
from mha_multi.interop import keras as interop  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402
from mha_multi.weights import init_weights, load_weights, save_weights  # noqa: E402

pytestmark = COPY_KEYWORD_WARNING


def native_call(layer, case, **kwargs):
    q, k, v = inputs(case)
    return layer(q, v, k, training=False, **kwargs)  # Keras' order: (query, value, key)


@pytest.mark.filterwarnings("ignore:You are using a softmax over axis:UserWarning")  # one_key
@pytest.mark.parametrize(
    "name", ["book", "bias", "lens_2d", "lens_zero", "causal_cross", "cross_sizes", "one_key"]
)
def test_native_layer_with_our_weights_matches_reference(cases, name):
    case = cases[name]
    config = case.config
    native = backend.native_layer(case.weights, config.num_heads)
    mask = None
    if case.valid_lens is not None or config.causal:
        mask = interop.attention_mask(
            case.valid_lens, config.num_queries, config.num_keys, causal=config.causal
        )
    out = native_call(native, case, attention_mask=mask)
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=5e-6)
    # The softmax path (with scores) too, on rows that see a key; its scores
    # are the spec's weights (fully hidden rows: see the test below).
    out, scores = native_call(native, case, attention_mask=mask, return_attention_scores=True)
    seen = np.ones((config.batch, config.num_queries), bool) if mask is None else mask.any(-1)
    seen = np.broadcast_to(seen, (config.batch, config.num_queries))
    np.testing.assert_allclose(
        backend.to_numpy(out)[seen], case.reference["output"][seen], atol=5e-6
    )
    np.testing.assert_allclose(
        backend.to_numpy(scores).transpose(0, 2, 1, 3)[seen],
        case.reference["attention_weights"].transpose(0, 2, 1, 3)[seen],
        atol=5e-6,
    )


@pytest.mark.parametrize("bias", [False, True])
def test_weights_from_a_native_layer_give_equal_outputs(runner, bias):
    native = keras.layers.MultiHeadAttention(4, 6, use_bias=bias, bias_initializer="random_normal")
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 5, 24)).astype(np.float32)
    kv = rng.standard_normal((3, 7, 11)).astype(np.float32)
    lens = np.array([7, 3, 0])
    mask = interop.attention_mask(lens, 5, 7)
    expected = backend.to_numpy(native(q, kv, kv, attention_mask=mask))
    weights = interop.from_keras_mha(native)
    assert weights["W_q"].shape == (24, 24) and weights["W_k"].shape == (11, 24)
    ours = runner.set_weights(runner.make_layer(24, 4, bias=bias), weights)
    np.testing.assert_allclose(runner.call(ours, q, kv, kv, lens), expected, atol=5e-6)
    reference, _ = spec.reference_forward(weights, q, kv, kv, lens, num_heads=4)
    np.testing.assert_allclose(expected, reference, atol=5e-6)


def test_round_trip_is_bit_exact():
    weights = init_weights(12, bias=True, seed=3, query_size=5, key_size=7, value_size=9)
    back = interop.from_keras_mha(interop.to_keras_mha(weights, 3))
    assert back.keys() == weights.keys()
    assert all(back[k].tobytes() == weights[k].astype(np.float32).tobytes() for k in weights)
    arrays = interop.to_keras_mha_state(weights, 3)
    assert arrays["query/kernel"].shape == (5, 3, 4)
    assert arrays["output/kernel"].shape == (3, 4, 12)
    assert arrays["value/bias"].shape == (3, 4) and arrays["output/bias"].shape == (12,)
    # Head h owns columns [h*dh, (h+1)*dh): the spec's layout.
    np.testing.assert_array_equal(arrays["key/kernel"][:, 1], weights["W_k"][:, 4:8])


def test_query_size_other_than_num_hiddens_sets_output_shape():
    weights = init_weights(8, seed=1, query_size=5)
    native = interop.to_keras_mha(weights, 2)
    q = np.ones((1, 3, 5), np.float32)
    kv = np.ones((1, 4, 8), np.float32)
    assert tuple(native(q, kv).shape) == (1, 3, 8)


# -- differences, checked as differences ----------------------------------------


def test_mask_polarity_is_the_opposite_of_hidden_keys():
    mask = interop.attention_mask(np.array([2, 0]), 1, 3)
    np.testing.assert_array_equal(mask, [[[True, True, False]], [[False, False, False]]])


def test_keras_causal_mask_is_top_left_aligned(cases):
    case = cases["causal_cross"]  # Q != K: the alignments differ
    assert case.config.num_queries != case.config.num_keys
    native = backend.native_layer(case.weights, case.config.num_heads)
    keras_causal = backend.to_numpy(native_call(native, case, use_causal_mask=True))
    expected, _ = spec.reference_forward(
        case.weights,
        *inputs(case),
        num_heads=case.config.num_heads,
        causal=True,
    )
    assert np.abs(keras_causal - expected).max() > 1e-2  # not the spec's rule
    top_left = np.tril(np.ones((case.config.num_queries, case.config.num_keys), bool))
    np.testing.assert_allclose(
        keras_causal,
        backend.to_numpy(native_call(native, case, attention_mask=top_left[None])),
        atol=5e-6,
    )
    square = interop.attention_mask(None, 4, 4, causal=True)[0]
    np.testing.assert_array_equal(square, np.tril(np.ones((4, 4), bool)))  # equal when Q == K


@pytest.mark.parametrize("name", ["lens_zero", "causal_more_queries", "bias"])
def test_keras_fully_hidden_rows_depend_on_its_path(cases, name):
    case = cases[name]
    config = case.config
    native = backend.native_layer(case.weights, config.num_heads)
    lens = case.valid_lens
    if name == "bias":  # hide every key of the second example
        lens = np.full(config.batch, config.num_keys)
        lens[1] = 0
    mask = interop.attention_mask(lens, config.num_queries, config.num_keys, causal=config.causal)
    hidden = np.broadcast_to(~mask.any(-1), (config.batch, config.num_queries))  # see no key
    assert hidden.any()
    expected, _ = spec.reference_forward(
        case.weights,
        *inputs(case),
        lens,
        num_heads=config.num_heads,
        causal=config.causal,
    )
    # Keras' fused path (no scores, no dropout): uniform weights, as in the spec.
    fused = backend.to_numpy(native_call(native, case, attention_mask=mask))
    np.testing.assert_allclose(fused, expected, atol=5e-6)
    # Keras' softmax path zeroes hidden weights after the softmax: a fully
    # hidden row attends to nothing, so its output is the output bias alone,
    # where the spec gives the mean of all values.
    out, scores = native_call(native, case, attention_mask=mask, return_attention_scores=True)
    out = backend.to_numpy(out)
    assert np.all(backend.to_numpy(scores).transpose(0, 2, 1, 3)[hidden] == 0)
    output_bias = case.weights.get("b_o", np.zeros(config.num_hiddens))
    np.testing.assert_allclose(
        out[hidden], np.broadcast_to(output_bias, out[hidden].shape), atol=1e-6
    )
    assert np.abs(out[hidden] - expected[hidden]).max() > 1e-3
    np.testing.assert_allclose(out[~hidden], expected[~hidden], atol=5e-6)


# -- unsupported options ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"value_dim": 3}, r"value_dim \(3\) != key_dim \(4\)"),
        ({"output_shape": 10}, r"output_shape=\(10,\)"),
        ({"attention_axes": (1, 2)}, r"attention_axes=\(1, 2\)"),
        # The batch or the heads' axis of 3-D inputs: Keras' einsum path attends over it.
        ({"attention_axes": (0,)}, r"attention_axes=\(0,\)"),
        ({"attention_axes": (2,)}, r"attention_axes=\(2,\)"),
        ({"use_gate": True}, "use_gate=True"),
        ({"sliding_window": 2}, "sliding_window=2"),
    ],
)
def test_unsupported_native_options_are_clear_errors(kwargs, message):
    native = keras.layers.MultiHeadAttention(2, 4, **kwargs)
    shape = (1, 3, 3, 8) if kwargs.get("attention_axes") == (1, 2) else (1, 3, 8)
    native.build(shape, shape)  # (calling it would hit a Keras bug on JAX with value_dim)
    with pytest.raises(ValueError, match=message):
        interop.from_keras_mha(native)
    if "value_dim" not in kwargs and "output_shape" not in kwargs:
        # Nor is a layer made with them: it would compute something else.
        with pytest.raises(ValueError, match=message):
            interop.to_keras_mha(init_weights(8, seed=0), 2, **kwargs)


def test_the_sequence_axis_converts_either_way():
    weights = init_weights(8, seed=0)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    expected, _ = spec.reference_forward(weights, x, x, x, num_heads=2)
    for axes in ((1,), (-2,)):
        native = interop.to_keras_mha(weights, 2, attention_axes=axes)
        output, _ = native(x, x, return_attention_scores=True)  # (Keras' einsum path)
        np.testing.assert_allclose(keras.ops.convert_to_numpy(output), expected, atol=5e-6)
        np.testing.assert_array_equal(interop.from_keras_mha(native)["W_q"], weights["W_q"])


def test_unbuilt_layer_is_a_clear_error():
    with pytest.raises(ValueError, match="not built yet"):
        interop.from_keras_mha(keras.layers.MultiHeadAttention(2, 4))


def test_bias_on_some_projections_only_is_a_clear_error():
    arrays = interop.to_keras_mha_state(init_weights(8, bias=True, seed=0), 2)
    del arrays["output/bias"]
    with pytest.raises(ValueError, match="biases on some projections only"):
        interop.from_keras_mha_state(arrays)


def test_output_size_other_than_num_hiddens_is_a_clear_error():
    arrays = interop.to_keras_mha_state(init_weights(8, seed=0), 2)
    arrays["output/kernel"] = np.zeros((2, 4, 5), np.float32)
    with pytest.raises(ValueError, match="output size 5 != num_heads"):
        interop.from_keras_mha_state(arrays)


def test_to_keras_mha_rejects_keywords_the_weights_fix():
    with pytest.raises(ValueError, match="key_dim follow from the weights"):
        interop.to_keras_mha(init_weights(8, seed=0), 2, key_dim=3)
    with pytest.raises(ValueError, match=r"num_hiddens \(8\) must be divisible by num_heads \(3\)"):
        interop.to_keras_mha(init_weights(8, seed=0), 3)


# -- d2l's Keras layer -----------------------------------------------------------------


class D2lMultiHeadAttention(keras.layers.Layer):
    """d2l's Keras/TensorFlow ``MultiHeadAttention``, on ``keras.ops`` (book structure)."""

    def __init__(self, num_hiddens, num_heads, bias=False, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.W_q = keras.layers.Dense(num_hiddens, use_bias=bias)
        self.W_k = keras.layers.Dense(num_hiddens, use_bias=bias)
        self.W_v = keras.layers.Dense(num_hiddens, use_bias=bias)
        self.W_o = keras.layers.Dense(num_hiddens, use_bias=bias)

    def transpose_qkv(self, x):
        ops = keras.ops
        x = ops.reshape(x, (x.shape[0], x.shape[1], self.num_heads, -1))
        x = ops.transpose(x, (0, 2, 1, 3))
        return ops.reshape(x, (-1, x.shape[2], x.shape[3]))

    def call(self, queries, keys, values, valid_lens):
        ops = keras.ops
        q, k, v = (
            self.transpose_qkv(dense(x))
            for dense, x in ((self.W_q, queries), (self.W_k, keys), (self.W_v, values))
        )
        scores = ops.matmul(q, ops.swapaxes(k, 1, 2)) / np.sqrt(q.shape[-1])
        lens = ops.repeat(ops.cast(valid_lens, "int32"), self.num_heads, axis=0)  # not tile
        visible = ops.arange(scores.shape[-1])[None, None, :] < lens[:, None, None]
        weights = ops.softmax(ops.where(visible, scores, -1e6), axis=-1)
        out = ops.matmul(weights, v)
        out = ops.reshape(out, (-1, self.num_heads, out.shape[1], out.shape[2]))
        out = ops.reshape(ops.transpose(out, (0, 2, 1, 3)), (out.shape[0], out.shape[2], -1))
        return self.W_o(out)


@pytest.mark.parametrize("bias", [False, True])
def test_d2l_keras_layer_weights_give_equal_outputs(runner, cases, bias):
    case = cases["book"]  # valid_lens [3, 2]
    config = case.config
    q, k, v = inputs(case)
    d2l = D2lMultiHeadAttention(config.num_hiddens, config.num_heads, bias=bias)
    expected = backend.to_numpy(d2l(q, k, v, case.valid_lens))
    weights = interop.from_keras_d2l(d2l)
    assert set(weights) == (
        {"W_q", "W_k", "W_v", "W_o"} | ({"b_q", "b_k", "b_v", "b_o"} if bias else set())
    )
    reference, _ = spec.reference_forward(
        weights, q, k, v, case.valid_lens, num_heads=config.num_heads
    )
    np.testing.assert_allclose(expected, reference, atol=5e-6)
    ours = runner.set_weights(
        runner.make_layer(config.num_hiddens, config.num_heads, bias=bias), weights
    )
    np.testing.assert_allclose(runner.call(ours, q, k, v, case.valid_lens), expected, atol=5e-6)
    # and back: ours -> d2l's
    other = D2lMultiHeadAttention(config.num_hiddens, config.num_heads, bias=bias)
    other(q, k, v, case.valid_lens)
    interop.to_keras_d2l(runner.get_weights(ours), other)
    np.testing.assert_allclose(
        backend.to_numpy(other(q, k, v, case.valid_lens)), expected, atol=5e-6
    )
    assert interop.from_keras_d2l(ours).keys() == weights.keys()


def test_what_is_no_state_or_layer_is_named():
    for read in (interop.from_keras_mha_state, interop.from_keras_gqa_state):
        with pytest.raises(TypeError, match="state must be a mapping of names to arrays; got"):
            read(None)
    with pytest.raises(TypeError, match="layer must be a keras.layers.MultiHeadAttention; got"):
        interop.from_keras_mha({})


def test_attention_mask_checks_the_lengths():
    for lens in (np.ones((1, 3), np.int32), np.ones((2, 2, 2), np.int32)):
        with pytest.raises(ValueError, match=r"valid_lens must have shape \(batch,\)"):
            interop.attention_mask(lens, 5, 5)


def test_d2l_layer_bias_mismatch_is_a_clear_error():
    d2l = D2lMultiHeadAttention(8, 2)
    x = np.ones((1, 2, 8), np.float32)
    d2l(x, x, x, np.array([2]))
    with pytest.raises(ValueError, match="W_q has no bias; the weights have biases"):
        interop.to_keras_d2l(init_weights(8, bias=True, seed=0), d2l)
    with pytest.raises(ValueError, match="has no W_q projection"):
        interop.from_keras_d2l(object())


def test_a_d2l_layer_with_an_activation_is_refused_both_ways():
    """d2l's projections are linear: one with an activation would convert to another
    computation (its weights were read and loaded as they are)."""
    d2l = D2lMultiHeadAttention(8, 2)
    x = np.ones((1, 2, 8), np.float32)
    d2l(x, x, x, np.array([2]))
    d2l.W_k.activation = keras.activations.relu
    with pytest.raises(ValueError, match="^W_k has the activation 'relu'; the canonical layer"):
        interop.from_keras_d2l(d2l)
    with pytest.raises(ValueError, match="^W_k has the activation 'relu'; the canonical layer"):
        interop.to_keras_d2l(init_weights(8, seed=0), d2l)


@pytest.mark.parametrize(
    ("options", "entry"), [({"sinks": True}, "sinks"), ({"qk_norm": {"scope": "heads"}}, "q_norm")]
)
def test_ours_with_weights_beyond_the_projections_is_no_d2l_layer(options, entry):
    """Read as d2l's layer, ours would lose them: the function computed would change."""
    from mha_multi.keras import MultiHeadAttention

    ours = MultiHeadAttention(8, 2, **options)
    x = np.ones((1, 2, 8), np.float32)
    ours(x, x, x)
    with pytest.raises(ValueError, match=f"unexpected entry '{entry}' in a d2l Multi"):
        interop.from_keras_d2l(ours)


# -- convert keras-mha --------------------------------------------------------------------


def test_convert_to_and_from_keras_weights_file(cases, tmp_path, capsys):
    case = cases["cross_sizes"]
    source = tmp_path / "weights.npz"
    save_weights(source, case.weights)
    keras_file = tmp_path / "mha.weights.h5"
    heads = str(case.config.num_heads)
    assert cli(["convert", str(source), str(keras_file), "--num-heads", heads]) == 0
    # Keras itself loads the file into a model of the same structure ...
    other = init_weights(
        case.config.num_hiddens, bias=case.config.bias, seed=9, **case.config.sizes()
    )
    native = interop.to_keras_mha(other, case.config.num_heads, name="multi_head_attention")
    sizes = case.config.sizes()
    inputs = [keras.Input((None, sizes[n])) for n in ("query_size", "value_size", "key_size")]
    model = keras.Model(inputs, native(*inputs))
    model.load_weights(keras_file)
    mask = interop.attention_mask(case.valid_lens, case.config.num_queries, case.config.num_keys)
    out = native_call(native, case, attention_mask=mask)
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=5e-6)
    # ... and it converts back bit-exactly.
    back = tmp_path / "back.safetensors"
    assert cli(["convert", str(keras_file), str(back)]) == 0
    restored = load_weights(back)
    assert all(restored[k].tobytes() == case.weights[k].tobytes() for k in case.weights)
    capsys.readouterr()


def test_convert_keras_mha_errors(tmp_path, capsys):
    weights = init_weights(8, seed=0)
    source = tmp_path / "w.npz"
    save_weights(source, weights)
    keras_file = tmp_path / "mha.weights.h5"
    assert cli(["convert", str(source), str(keras_file)]) == 2
    assert "writing keras-mha needs --num-heads" in capsys.readouterr().err
    assert cli(["convert", str(source), str(keras_file), "--num-heads", "2"]) == 0
    assert cli(["convert", str(keras_file), str(tmp_path / "x.npz"), "--num-heads", "4"]) == 2
    assert "--num-heads 4 does not match the 2 heads stored" in capsys.readouterr().err
    # A file with no attention layer at all.
    dense_file = tmp_path / "dense.weights.h5"
    x = keras.Input((3,))
    keras.Model(x, keras.layers.Dense(2)(x)).save_weights(dense_file)
    assert cli(["convert", str(dense_file), str(tmp_path / "y.npz")]) == 2
    assert (
        "must hold exactly one keras.layers.MultiHeadAttention; found 0" in capsys.readouterr().err
    )
    # A file whose value projection has another head size.
    import h5py

    with h5py.File(keras_file, "r+") as file:
        group = file["layers/multi_head_attention/value_dense/vars"]
        del group["0"]
        group["0"] = np.zeros((8, 2, 3), np.float32)
    assert cli(["convert", str(keras_file), str(tmp_path / "z.npz")]) == 2
    assert "value_dim (3) != key_dim (4)" in capsys.readouterr().err


# -- keras.layers.GroupQueryAttention -------------------------------------------------------


def grouped_weights(bias):
    """Canonical weights of 4 query heads reading 2 key/value heads of size 3,
    whose width (12) is not the output's (10): an explicit head_dim."""
    heads = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 3}
    return init_weights(10, key_size=6, value_size=7, bias=bias, seed=6, **heads)


@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_gqa_layer_with_our_weights_matches_reference(cases, name):
    case = cases[name]
    config = case.config
    native = interop.to_keras_gqa(case.weights, num_heads=config.num_heads)
    assert (native.num_query_heads, native.num_key_value_heads) == (
        config.num_heads,
        config.num_kv_heads,
    )
    assert native.use_bias == config.bias
    mask = interop.attention_mask(
        case.valid_lens, config.num_queries, config.num_keys, causal=config.causal
    )
    # Keras' fused path, fully hidden rows included (gqa: lengths [4, 7, 0]).
    out = native_call(native, case, attention_mask=mask)
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], rtol=0, atol=5e-6)
    # The softmax path: its scores are the spec's weights, per query head, on
    # rows that see a key.
    out, scores = native_call(native, case, attention_mask=mask, return_attention_scores=True)
    seen = np.broadcast_to(mask.any(-1), (config.batch, config.num_queries))
    np.testing.assert_allclose(
        backend.to_numpy(out)[seen], case.reference["output"][seen], rtol=0, atol=5e-6
    )
    np.testing.assert_allclose(
        backend.to_numpy(scores).transpose(0, 2, 1, 3)[seen],
        case.reference["attention_weights"].transpose(0, 2, 1, 3)[seen],
        rtol=0,
        atol=5e-6,
    )


@pytest.mark.parametrize("bias", [False, True])
def test_weights_from_a_gqa_layer_give_equal_outputs(runner, bias):
    # An explicit head_dim (3 with 10 hiddens) and 2 of 4 key/value heads;
    # key and value sizes of their own.
    native = keras.layers.GroupQueryAttention(
        3, 4, 2, use_bias=bias, bias_initializer="random_normal", seed=0
    )
    rng = np.random.default_rng(7)
    q = rng.standard_normal((3, 5, 10)).astype(np.float32)
    k = rng.standard_normal((3, 7, 6)).astype(np.float32)
    v = rng.standard_normal((3, 7, 11)).astype(np.float32)
    lens = np.array([[7, 1, 3, 0, 5], [2, 2, 2, 2, 2], [7, 7, 7, 7, 7]])
    mask = interop.attention_mask(lens, 5, 7)
    expected = backend.to_numpy(native(q, v, k, attention_mask=mask))  # Keras' order
    weights, heads = interop.from_keras_gqa(native)
    assert heads == {"num_heads": 4, "num_kv_heads": 2, "head_dim": 3}
    assert weights["W_q"].shape == (10, 12) and weights["W_v"].shape == (11, 6)
    assert weights["W_o"].shape == (12, 10)
    assert ("b_k" in weights) == bias
    reference, _ = spec.reference_forward(weights, q, k, v, lens, num_heads=4)
    np.testing.assert_allclose(expected, reference, rtol=0, atol=5e-6)
    ours = runner.set_weights(runner.make_layer(10, bias=bias, **heads), weights)
    np.testing.assert_allclose(runner.call(ours, q, k, v, lens), expected, rtol=0, atol=5e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_gqa_round_trip_is_bit_exact(bias):
    weights = grouped_weights(bias)
    native = interop.to_keras_gqa(weights, num_heads=4)  # num_kv_heads read from W_k
    assert (native.head_dim, native.num_key_value_heads) == (3, 2)
    back, heads = interop.from_keras_gqa(native)
    assert heads == {"num_heads": 4, "num_kv_heads": 2, "head_dim": 3}
    assert back.keys() == weights.keys()
    assert all(back[n].tobytes() == weights[n].astype(np.float32).tobytes() for n in weights)
    arrays = interop.to_keras_gqa_state(weights, num_heads=4, num_kv_heads=2)
    assert arrays["query/kernel"].shape == (10, 4, 3)
    assert arrays["key/kernel"].shape == (6, 2, 3) and arrays["value/kernel"].shape == (7, 2, 3)
    assert arrays["attention_output/kernel"].shape == (4, 3, 10)
    # Head h owns columns [h*dh, (h+1)*dh): the spec's layout.
    np.testing.assert_array_equal(arrays["value/kernel"][:, 1], weights["W_v"][:, 3:6])
    if bias:
        assert arrays["key/bias"].shape == (2, 3) and arrays["attention_output/bias"].shape == (10,)
    state_back, _ = interop.from_keras_gqa_state(arrays)
    assert all(state_back[n].tobytes() == weights[n].tobytes() for n in weights)


def test_gqa_layer_reads_key_value_head_h_over_group_size():
    # Query head h sees the scores of key/value head h // G and no other:
    # with the heads' key projections set apart, the layer's scores are those
    # of the repeated heads, in this order, and not tiled.
    weights = grouped_weights(False)
    native = interop.to_keras_gqa(weights, num_heads=4)
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 2, 10)).astype(np.float32)
    k = rng.standard_normal((1, 3, 6)).astype(np.float32)
    v = rng.standard_normal((1, 3, 7)).astype(np.float32)
    _, scores = native(q, v, k, return_attention_scores=True)
    projected_q = (q @ weights["W_q"]).reshape(1, 2, 4, 3)
    projected_k = (k @ weights["W_k"]).reshape(1, 3, 2, 3)
    logits = np.einsum("bqhd,bkhd->bhqk", projected_q, projected_k[:, :, [0, 0, 1, 1]]) / np.sqrt(3)
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(backend.to_numpy(scores), expected, rtol=0, atol=5e-6)


def test_gqa_causal_mask_is_top_left_aligned(cases):
    case = cases["gqa"]  # Q = 5 < K = 7: the alignments differ
    config = case.config
    assert config.num_queries != config.num_keys
    native = interop.to_keras_gqa(case.weights, num_heads=config.num_heads)
    keras_causal = backend.to_numpy(native_call(native, case, use_causal_mask=True))
    expected, _ = spec.reference_forward(
        case.weights, *inputs(case), num_heads=config.num_heads, causal=True
    )
    assert np.abs(keras_causal - expected).max() > 1e-2  # not the spec's rule
    top_left = np.tril(np.ones((config.num_queries, config.num_keys), bool))
    np.testing.assert_allclose(
        keras_causal,
        backend.to_numpy(native_call(native, case, attention_mask=top_left[None])),
        rtol=0,
        atol=5e-6,
    )
    # attention_mask(causal=True) gives the spec's rule.
    mask = interop.attention_mask(None, config.num_queries, config.num_keys, causal=True)
    np.testing.assert_allclose(
        backend.to_numpy(native_call(native, case, attention_mask=mask)),
        expected,
        rtol=0,
        atol=5e-6,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_gate": True}, "use_gate=True"),
        ({"sliding_window": 2}, "sliding_window=2"),
    ],
)
def test_unsupported_gqa_options_are_clear_errors(kwargs, message):
    native = keras.layers.GroupQueryAttention(4, 2, 1, **kwargs)
    native.build((1, 3, 8), (1, 3, 8))
    with pytest.raises(ValueError, match=message):
        interop.from_keras_gqa(native)
    with pytest.raises(ValueError, match="unsupported: " + next(iter(kwargs))):
        interop.to_keras_gqa(grouped_weights(False), num_heads=4, **kwargs)


def test_gqa_conversion_errors():
    with pytest.raises(ValueError, match="not built yet"):
        interop.from_keras_gqa(keras.layers.GroupQueryAttention(4, 2, 1))
    with pytest.raises(TypeError, match="layer must be a keras.layers.GroupQueryAttention"):
        interop.from_keras_gqa(keras.layers.MultiHeadAttention(2, 4))
    weights = grouped_weights(True)
    with pytest.raises(ValueError, match="head_dim, use_bias follow from the weights"):
        interop.to_keras_gqa(weights, num_heads=4, head_dim=3, use_bias=True)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
        interop.to_keras_gqa(weights, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"query_size \(5\) must equal num_hiddens \(10\)"):
        interop.to_keras_gqa_state(
            init_weights(10, num_heads=4, num_kv_heads=2, head_dim=3, query_size=5, seed=0),
            num_heads=4,
        )
    arrays = interop.to_keras_gqa_state(weights, num_heads=4)
    with pytest.raises(ValueError, match="biases on some projections only"):
        interop.from_keras_gqa_state({k: a for k, a in arrays.items() if k != "key/bias"})
    with pytest.raises(ValueError, match="use_gate=True"):
        interop.from_keras_gqa_state({**arrays, "gate/kernel": arrays["query/kernel"]})
    wrong = {**arrays, "value/kernel": np.zeros((7, 2, 4), np.float32)}
    with pytest.raises(ValueError, match=r"value kernel must have shape \(in, 2, 3\)"):
        interop.from_keras_gqa_state(wrong)


@pytest.mark.parametrize(
    ("heads", "message"),
    [
        ({"num_kv_heads": 2}, "keras.layers.MultiHeadAttention has no grouped key/value heads"),
        ({"head_dim": 3}, "hold the default head size"),
    ],
)
def test_keras_mha_converters_refuse_other_head_layouts(tmp_path, capsys, heads, message):
    weights = init_weights(8, num_heads=4, seed=0, **heads)
    with pytest.raises(ValueError, match=message):
        interop.to_keras_mha(weights, 4)
    with pytest.raises(ValueError, match=message):
        interop.to_keras_mha_state(weights, 4)
    with pytest.raises(ValueError, match=message):
        interop.save_keras_mha(tmp_path / "w.weights.h5", weights, num_heads=4)
    source = tmp_path / "w.npz"
    save_weights(source, weights)
    target = tmp_path / "mha.weights.h5"
    assert cli(["convert", str(source), str(target), "--num-heads", "4"]) == 2
    assert "GroupQueryAttention" in capsys.readouterr().err
    assert not target.exists()
