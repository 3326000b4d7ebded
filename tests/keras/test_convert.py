"""``python -m mha_multi convert`` with Keras weights files: ``keras-gqa``
(``keras.layers.GroupQueryAttention``) beside ``keras-mha``, and ``llama`` to
``keras-gqa`` and back.

The numbers are checked against the native layer's output and the float64
reference on the same weights; files written here are loaded by Keras itself.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from cli import PREFIX, convert_error  # noqa: E402
from keras_testing import COPY_KEYWORD_WARNING  # noqa: E402

from mha_multi import spec  # noqa: E402
from mha_multi.__main__ import main as cli  # noqa: E402
from mha_multi.interop import detect_format, load  # noqa: E402
from mha_multi.interop import keras as interop  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402
from mha_multi.weights import init_weights, load_weights, save_weights  # noqa: E402

pytestmark = COPY_KEYWORD_WARNING


def gqa_model(head_dim, num_heads, num_kv_heads, *, query_size, key_size, bias=True, seed=0):
    """A functional model of one ``GroupQueryAttention`` (Keras' default name), random weights.

    Keras builds the layer in a model only for values of the query's size.
    """
    layer = keras.layers.GroupQueryAttention(
        head_dim,
        num_heads,
        num_kv_heads,
        use_bias=bias,
        bias_initializer="random_normal",
        kernel_initializer=keras.initializers.RandomNormal(seed=seed),
        seed=seed,
    )
    query = keras.Input((None, query_size), name="query")
    value = keras.Input((None, query_size), name="value")
    key = keras.Input((None, key_size), name="key")
    return keras.Model([query, value, key], layer(query, value, key)), layer


def random_inputs(query_size, key_size, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((3, 5, query_size)).astype(np.float32)
    k = rng.standard_normal((3, 7, key_size)).astype(np.float32)
    v = rng.standard_normal((3, 7, query_size)).astype(np.float32)
    lens = np.array([7, 2, 4])
    return q, k, v, lens


def native_output(layer, q, k, v, lens):
    mask = interop.attention_mask(lens, q.shape[1], k.shape[1])
    return backend.to_numpy(layer(q, v, k, attention_mask=mask))  # Keras' order


def error_of(*args) -> str:
    """The one line on stderr of a command that fails with status 2 (its message).

    A process of its own, the command's as a user runs it: Keras' backend may
    log to stderr when it is imported, the error stays one line. The other
    messages are read in this process (``convert_error``).
    """
    result = subprocess.run(
        [sys.executable, "-m", "mha_multi", "convert", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 1, result.stderr
    return lines[0][len(PREFIX) :]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 3), (4, 1, 4)])
def test_native_gqa_file_gives_the_layer_output(
    tmp_path, capsys, bias, num_heads, num_kv_heads, head_dim
):
    model, layer = gqa_model(
        head_dim, num_heads, num_kv_heads, query_size=10, key_size=6, bias=bias
    )
    native_file = tmp_path / "model.weights.h5"
    model.save_weights(native_file)
    assert interop.weights_file_format(native_file) == "keras-gqa"
    assert detect_format(native_file, reading=True) == "keras-gqa"
    canonical = tmp_path / "canonical.safetensors"
    assert cli(["convert", str(native_file), str(canonical)]) == 0  # the file stores the heads
    weights = load_weights(canonical)
    assert ("b_k" in weights) == bias
    assert weights["W_k"].shape == (6, num_kv_heads * head_dim)
    q, k, v, lens = random_inputs(10, 6)
    expected, _ = spec.reference_forward(
        weights, q, k, v, lens, num_heads=num_heads, num_kv_heads=num_kv_heads
    )
    np.testing.assert_allclose(native_output(layer, q, k, v, lens), expected, rtol=0, atol=5e-6)
    # The options, where given, are checked against the file and printed.
    args = ["--num-heads", str(num_heads), "--num-kv-heads", str(num_kv_heads)]
    assert cli(["convert", str(native_file), str(tmp_path / "again.npz"), *args]) == 0
    printed = capsys.readouterr().out.rstrip()
    assert printed.endswith(
        f"num_heads {num_heads}, num_kv_heads {num_kv_heads}, head_dim {head_dim}"
    )


@pytest.mark.parametrize("bias", [False, True])
def test_canonical_to_keras_gqa_loads_into_keras_and_back(tmp_path, bias):
    weights = init_weights(
        10, key_size=6, bias=bias, seed=3, num_heads=4, num_kv_heads=2, head_dim=3
    )
    source = tmp_path / "canonical.npz"
    save_weights(source, weights)
    keras_file = tmp_path / "gqa.weights.h5"
    # .weights.h5 is written as keras-mha unless --to says otherwise.
    assert detect_format(keras_file, reading=False) == "keras-mha"
    args = ["--to", "keras-gqa", "--num-heads", "4"]
    assert cli(["convert", str(source), str(keras_file), *args]) == 0
    assert detect_format(keras_file, reading=True) == "keras-gqa"
    # Keras loads the file into a model of the same structure, other weights at first.
    model, layer = gqa_model(3, 4, 2, query_size=10, key_size=6, bias=bias, seed=5)
    model.load_weights(keras_file)
    q, k, v, lens = random_inputs(10, 6, seed=1)
    expected, _ = spec.reference_forward(weights, q, k, v, lens, num_heads=4, num_kv_heads=2)
    np.testing.assert_allclose(native_output(layer, q, k, v, lens), expected, rtol=0, atol=5e-6)
    back = tmp_path / "back.safetensors"
    assert cli(["convert", str(keras_file), str(back)]) == 0
    restored = load_weights(back)
    assert all(restored[n].tobytes() == weights[n].tobytes() for n in weights)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("format_name", ["keras-mha", "keras-gqa"])
def test_keras_files_keep_the_weights_dtype(tmp_path, format_name, dtype):
    """The file's variables are the weights' dtype: they come back bit for bit (Keras'
    default layer dtype would round float64 weights and widen float16 ones)."""
    weights = init_weights(8, bias=True, seed=3, num_heads=2, dtype=dtype)
    source, keras_file = tmp_path / "canonical.npz", tmp_path / "file.weights.h5"
    save_weights(source, weights)
    args = ["--to", format_name, "--num-heads", "2"]
    if dtype == np.float64 and backend.BACKEND == "jax":
        import jax

        if not jax.config.jax_enable_x64:  # (its float64 variables hold float32 values)
            message = convert_error(source, keras_file, *args)
            assert "holds float64 weights as float32: the file would change them" in message
            assert not keras_file.exists()
            return
    assert cli(["convert", str(source), str(keras_file), *args]) == 0
    back = tmp_path / "back.npz"
    assert cli(["convert", str(keras_file), str(back), "--from", format_name]) == 0
    restored = load_weights(back)
    assert all(restored[n].dtype == dtype for n in weights)
    assert all(restored[n].tobytes() == weights[n].tobytes() for n in weights)


def test_mha_and_gqa_files_are_told_apart(tmp_path):
    weights = init_weights(8, bias=True, seed=0)
    mha_file = tmp_path / "mha.weights.h5"
    interop.save_keras_mha(mha_file, weights, num_heads=2)
    gqa_file = tmp_path / "gqa.weights.h5"
    interop.save_keras_gqa(gqa_file, weights, num_heads=2)  # d2l's layout, in GroupQueryAttention
    assert interop.weights_file_format(mha_file) == "keras-mha"
    assert interop.weights_file_format(gqa_file) == "keras-gqa"
    for path in (mha_file, gqa_file):
        back = load(path, num_heads=2)
        assert all(back[n].tobytes() == weights[n].tobytes() for n in weights)
    # A file with no attention layer is left to keras-mha's reader, which says so.
    dense_file = tmp_path / "dense.weights.h5"
    x = keras.Input((3,))
    keras.Model(x, keras.layers.Dense(2)(x)).save_weights(dense_file)
    assert interop.weights_file_format(dense_file) == "keras-mha"
    # --from names the format to check the file against.
    assert error_of(mha_file, tmp_path / "x.npz", "--from", "keras-gqa") == (
        f"{str(mha_file)!r} must hold exactly one keras.layers.GroupQueryAttention; found 0"
    )


def test_keras_gqa_head_options_are_checked_against_the_file(tmp_path):
    model, _ = gqa_model(3, 4, 2, query_size=10, key_size=6)
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)
    shapes = "(query kernel shape (10, 4, 3), key kernel shape (6, 2, 3))"
    out = tmp_path / "out.npz"
    assert convert_error(path, out, "--num-kv-heads", "1") == (
        f"--num-kv-heads 1 does not match the 2 key/value heads stored in {str(path)!r} {shapes}"
    )
    assert convert_error(path, out, "--head-dim", "6") == (
        f"--head-dim 6 does not match the head_dim 3 stored in {str(path)!r} {shapes}"
    )
    assert convert_error(path, out, "--num-heads", "2") == (
        f"--num-heads 2 does not match the 4 heads stored in {str(path)!r} {shapes}"
    )
    assert not out.exists()


def test_grouped_weights_to_keras_mha_name_keras_gqa(tmp_path):
    model, _ = gqa_model(3, 4, 2, query_size=10, key_size=6)
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)
    target = tmp_path / "mha.weights.h5"
    assert convert_error(path, target, "--num-heads", "4") == (
        "keras.layers.MultiHeadAttention has no grouped key/value heads (num_kv_heads < "
        "num_heads): W_k and W_v have 6 columns, W_q 12; keras.layers.GroupQueryAttention holds "
        "them (mha_multi.interop.keras.to_keras_gqa); its files are the keras-gqa format"
    )
    assert not target.exists()


def test_keras_gqa_files_that_cannot_be_converted(tmp_path):
    out = tmp_path / "out.npz"
    # A gate has no canonical form.
    layer = keras.layers.GroupQueryAttention(3, 4, 2, use_gate=True)
    query = keras.Input((None, 10))
    gated = tmp_path / "gated.weights.h5"
    keras.Model(query, layer(query, query)).save_weights(gated)
    assert convert_error(gated, out) == (
        "unsupported keras.layers.GroupQueryAttention option: use_gate=True "
        "(the canonical layer has no gate)"
    )
    # Two layers: which one is meant?
    first = keras.layers.GroupQueryAttention(3, 4, 2)
    second = keras.layers.GroupQueryAttention(3, 4, 2)
    hidden = first(query, query)
    two = tmp_path / "two.weights.h5"
    keras.Model(query, second(hidden, hidden)).save_weights(two)
    message = convert_error(two, out)
    assert message.startswith(
        f"{str(two)!r} must hold exactly one keras.layers.GroupQueryAttention; found 2 ["
    )
    # A damaged file.
    damaged = tmp_path / "damaged.weights.h5"
    damaged.write_bytes(gated.read_bytes()[:100])
    assert convert_error(damaged, out).startswith(
        f"{str(damaged)!r} is not a readable .weights.h5 file"
    )
    assert not out.exists()


def test_weights_keras_gqa_files_cannot_hold(tmp_path):
    heads = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 3}
    target = tmp_path / "gqa.weights.h5"
    source = tmp_path / "values.npz"
    save_weights(source, init_weights(10, value_size=7, seed=0, **heads))
    assert convert_error(source, target, "--to", "keras-gqa", "--num-heads", "4") == (
        "keras.layers.GroupQueryAttention takes values of the query's size in a model (Keras "
        "checks the shapes when it builds one): value_size (7) must equal query_size (10)"
    )
    save_weights(source, init_weights(10, query_size=5, seed=0, **heads))
    assert convert_error(source, target, "--to", "keras-gqa", "--num-heads", "4") == (
        "keras.layers.GroupQueryAttention projects back to the query size: query_size (5) must "
        "equal num_hiddens (10)"
    )
    assert convert_error(source, target, "--to", "keras-gqa") == (
        "writing keras-gqa needs --num-heads (or --num-kv-heads or --head-dim): the kernels are "
        "per head"
    )
    assert not target.exists()


def test_llama_to_keras_gqa_and_back(tmp_path):
    torch = pytest.importorskip("torch")  # the llama format's files are PyTorch's
    weights = init_weights(16, bias=True, seed=8, num_heads=4, num_kv_heads=2, head_dim=6)
    canonical = tmp_path / "canonical.safetensors"
    save_weights(canonical, weights)
    llama = tmp_path / "attention.bin"
    assert cli(["convert", str(canonical), str(llama), "--num-heads", "4"]) == 0
    state = torch.load(llama, weights_only=True)
    np.testing.assert_array_equal(state["k_proj.weight"].numpy(), weights["W_k"].T)
    np.testing.assert_array_equal(state["o_proj.bias"].numpy(), weights["b_o"])
    keras_file = tmp_path / "gqa.weights.h5"
    args = ["--to", "keras-gqa", "--num-kv-heads", "2"]
    assert cli(["convert", str(llama), str(keras_file), *args]) == 0
    model, layer = gqa_model(6, 4, 2, query_size=16, key_size=16, seed=4)
    model.load_weights(keras_file)
    q, k, v, lens = random_inputs(16, 16, seed=2)
    expected, _ = spec.reference_forward(weights, q, k, v, lens, num_heads=4, num_kv_heads=2)
    np.testing.assert_allclose(native_output(layer, q, k, v, lens), expected, rtol=0, atol=5e-6)
    # And back to a Llama state dict, as safetensors this time, and to canonical weights.
    again = tmp_path / "again.safetensors"
    assert cli(["convert", str(keras_file), str(again), "--to", "llama", "--head-dim", "6"]) == 0
    assert detect_format(again, reading=True) == "llama"
    back = tmp_path / "back.npz"
    assert cli(["convert", str(again), str(back), "--num-heads", "4"]) == 0
    restored = load_weights(back)
    assert all(restored[n].tobytes() == weights[n].tobytes() for n in weights)
