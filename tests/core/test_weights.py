"""Canonical weights: shapes, seeded init, strict checks, bit-exact files."""

from __future__ import annotations

import io
import json
import struct
import zipfile

import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.numpy import save as safetensors_bytes

from mha_multi.weights import check_weights, init_weights, load_weights, save_weights, weight_shapes


def test_shapes():
    kernels = {"W_q": (3, 8), "W_k": (4, 8), "W_v": (5, 8), "W_o": (8, 8)}
    biases = {"b_q": (8,), "b_k": (8,), "b_v": (8,), "b_o": (8,)}
    shapes = weight_shapes(8, query_size=3, key_size=4, value_size=5, bias=True)
    assert shapes == {**kernels, **biases}
    assert set(weight_shapes(8)) == {"W_q", "W_k", "W_v", "W_o"}


def test_init_is_seeded_and_bounded():
    a = init_weights(16, query_size=4, bias=True, seed=3)
    b = init_weights(16, query_size=4, bias=True, seed=3)
    c = init_weights(16, query_size=4, bias=True, seed=4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["W_q"], c["W_q"])
    assert np.abs(a["W_q"]).max() <= 1 / np.sqrt(4)
    assert np.abs(a["b_o"]).max() <= 1 / np.sqrt(16)
    assert a["W_q"].dtype == np.float32


def test_check_infers_config():
    _, config = check_weights(init_weights(12, key_size=7, bias=True))
    assert (config.num_hiddens, config.query_size, config.key_size, config.bias) == (
        12,
        12,
        7,
        True,
    )


@pytest.mark.parametrize(
    ("edit", "kwargs", "match"),
    [
        (lambda w: w.pop("W_k"), {}, "missing 'W_k'"),
        (lambda w: w.pop("b_v"), {"bias": True}, "missing 'b_v'"),
        (
            lambda w: w.update(b_q=np.zeros(8, np.float32)),
            {"bias": False},
            "unexpected entry 'b_q'",
        ),
        (lambda w: w.update(extra=np.zeros(1)), {}, "unexpected entry 'extra'"),
        (
            lambda w: w.update(W_o=np.zeros((8, 9), np.float32)),
            {"num_hiddens": 8},
            r"W_o'\] must have shape",
        ),
        (
            lambda w: w.update(W_q=np.zeros((5, 8), np.float32)),
            {"query_size": 8},
            r"W_q'\] must have shape \(8, 8\)",
        ),
        (lambda w: w.update(W_v=np.zeros(8, np.float32)), {}, "must be 2-D"),
        (lambda w: w.update(W_q=np.zeros((0, 8), np.float32)), {}, r"W_q'\] must not be empty"),
    ],
)
def test_check_is_strict(edit, kwargs, match):
    weights = init_weights(8, bias=kwargs.get("bias", False))
    edit(weights)
    with pytest.raises(ValueError, match=match):
        check_weights(weights, **kwargs)


@pytest.mark.parametrize("size", ["query_size", "key_size", "value_size"])
def test_sizes_of_zero_are_refused_by_name(size):
    with pytest.raises(ValueError, match=f"{size} must be a positive int; got 0"):
        init_weights(8, num_heads=2, **{size: 0})
    with pytest.raises(ValueError, match="num_hiddens must be a positive int; got 0"):
        weight_shapes(0)


def test_check_rejects_non_float_and_non_mapping():
    weights = init_weights(4)
    weights["W_q"] = weights["W_q"].astype(np.int32)
    with pytest.raises(TypeError, match="floating-point"):
        check_weights(weights)
    with pytest.raises(TypeError, match="mapping"):
        check_weights([np.zeros((4, 4))])


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_file_round_trip_is_bit_exact(tmp_path, suffix, dtype):
    weights = init_weights(10, value_size=3, bias=True, seed=7, dtype=dtype)
    path = tmp_path / f"weights{suffix}"
    save_weights(path, weights)
    loaded = load_weights(path)
    assert loaded.keys() == weights.keys()
    for name in weights:
        assert loaded[name].dtype == weights[name].dtype
        assert loaded[name].tobytes() == weights[name].tobytes()


def test_files_refuse_other_formats_and_invalid_weights(tmp_path):
    with pytest.raises(ValueError, match=r"\.npz or \.safetensors"):
        save_weights(tmp_path / "weights.pt", init_weights(4))
    with pytest.raises(ValueError, match="missing 'W_k'"):
        save_weights(tmp_path / "weights.npz", {"W_q": np.zeros((4, 4))})
    assert not (tmp_path / "weights.npz").exists()


def test_npz_load_refuses_pickles(tmp_path):
    path = tmp_path / "weights.npz"
    weights = dict(init_weights(4))
    np.savez(path, **weights, W_extra=np.array([object()], dtype=object))
    with pytest.raises(ValueError) as info:
        load_weights(path)
    assert str(info.value) == (
        f"{str(path)!r} is not a valid .npz file: "
        "Object arrays cannot be loaded when allow_pickle=False"
    )


@pytest.mark.parametrize("member", ["W_q.npy", "W_q"])
def test_npz_load_refuses_a_name_held_twice(tmp_path, member):
    """A zip archive may hold a member twice (appended), or as ``W_q`` beside
    ``W_q.npy``: numpy reads the last, which is no choice to make silently."""
    import io
    import warnings
    import zipfile

    path = tmp_path / "weights.npz"
    save_weights(path, init_weights(4))
    stream = io.BytesIO()
    np.save(stream, np.full((4, 4), 7.0, np.float32))
    with zipfile.ZipFile(path, "a") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (zipfile's "Duplicate name")
        archive.writestr(member, stream.getvalue())
    with pytest.raises(ValueError) as info:
        load_weights(path)
    assert str(info.value) == f"{str(path)!r} is not a valid .npz file: it holds 'W_q' twice"


def saved(tmp_path, suffix):
    path = tmp_path / f"weights{suffix}"
    save_weights(path, init_weights(8, bias=True, seed=1))
    return path, path.read_bytes()


def truncated_load_error(tmp_path, suffix, keep):
    """``(path, size, error)`` of loading a saved file cut to ``keep`` bytes
    (negative: from the end; a float: that fraction of them)."""
    path, data = saved(tmp_path, suffix)
    size = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    path.write_bytes(data[:size])
    with pytest.raises(ValueError) as info:
        load_weights(path)
    return path, size, info.value


# Cut inside the signature, mid-file and one byte short. An empty .npz file is
# the case where numpy 1.23 (a pickle error) and numpy 2 (EOFError) differ.
@pytest.mark.parametrize("keep", [0, 3, 0.5, -1])
def test_truncated_npz_is_a_value_error_naming_the_file(tmp_path, keep):
    path, size, error = truncated_load_error(tmp_path, ".npz", keep)
    if size < 4:
        assert str(error) == (
            f"{str(path)!r} is not a valid .npz file: it is not a zip archive "
            "(truncated, or another format)"
        )
    else:
        assert str(error) == (
            f"{str(path)!r} is not a valid .npz file (truncated or corrupt): File is not a zip file"
        )
        assert isinstance(error.__cause__, zipfile.BadZipFile)


def test_corrupt_npz_is_a_value_error_naming_the_file(tmp_path):
    path, data = saved(tmp_path, ".npz")
    # Flip a byte of W_q's data (after the 30-byte zip entry header and the
    # 128-byte .npy header): the archive stays well-formed, its CRC fails.
    corrupt = bytearray(data)
    corrupt[30 + len("W_q.npy") + 128 + 5] ^= 0xFF
    path.write_bytes(bytes(corrupt))
    with pytest.raises(ValueError) as info:
        load_weights(path)
    assert str(info.value) == (
        f"{str(path)!r} is not a valid .npz file (truncated or corrupt): "
        "Bad CRC-32 for file 'W_q.npy'"
    )


@pytest.mark.parametrize("keep", [0, 5, 12, 0.5, -1])
def test_truncated_safetensors_is_a_value_error_naming_the_file(tmp_path, keep):
    path, _, error = truncated_load_error(tmp_path, ".safetensors", keep)
    prefix = f"{str(path)!r} is not a valid .safetensors file (truncated or corrupt): "
    assert str(error).startswith(prefix)
    assert isinstance(error.__cause__, SafetensorError)
    assert str(error) == prefix + str(error.__cause__)


def test_corrupt_safetensors_header_is_a_value_error(tmp_path):
    path, data = saved(tmp_path, ".safetensors")
    corrupt = bytearray(data)
    corrupt[8] = ord("]")  # the JSON header's opening brace
    path.write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match=r"is not a valid \.safetensors file") as info:
        load_weights(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value.__cause__, SafetensorError)


def test_empty_files_are_the_same_value_error(tmp_path):
    npz = tmp_path / "empty.npz"
    np.savez(npz)  # no arrays: an empty zip archive
    safetensors = tmp_path / "empty.safetensors"
    safetensors.write_bytes(safetensors_bytes({}))
    for path in (npz, safetensors):
        with pytest.raises(ValueError) as info:
            load_weights(path)
        assert str(info.value) == (
            f"{str(path)!r} holds no arrays; expected canonical weights W_q, W_k, W_v, W_o"
        )


def test_invalid_weights_in_a_file_are_named_with_the_file(tmp_path):
    path = tmp_path / "weights.npz"
    weights = init_weights(4)
    del weights["W_k"]
    np.savez(path, **weights)
    with pytest.raises(ValueError) as info:
        load_weights(path)
    assert str(info.value) == f"{str(path)!r}: weights is missing 'W_k'"
    np.savez(path, **{**init_weights(4), "W_q": np.zeros((4, 4), np.int32)})
    with pytest.raises(TypeError) as info:
        load_weights(path)
    assert str(info.value) == (
        f"{str(path)!r}: weights['W_q'] must be a floating-point array; got dtype int32"
    )


@pytest.mark.parametrize(
    ("dtype", "size", "named"),
    # What torch writes for a bfloat16 model; numpy has no bfloat16, nor float8 (which
    # safetensors asked numpy for by name: an AttributeError).
    [("BF16", 8, "bfloat16"), ("F8_E4M3", 4, "")],
    ids=["bfloat16", "float8"],
)
def test_a_safetensors_dtype_numpy_lacks_is_a_type_error(tmp_path, dtype, size, named):
    header = json.dumps({"W_q": {"dtype": dtype, "shape": [2, 2], "data_offsets": [0, size]}})
    path = tmp_path / "lacking.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(size))
    with pytest.raises(TypeError) as info:
        load_weights(path)
    assert str(info.value).startswith(f"{str(path)!r} holds a tensor numpy cannot represent (")
    assert named in str(info.value)


def test_an_npz_member_claiming_more_than_memory_is_a_damaged_file(tmp_path):
    path = tmp_path / "claims.npz"
    with zipfile.ZipFile(path, "w") as archive:
        header = io.BytesIO()
        shape = {"descr": "<f4", "fortran_order": False, "shape": (2**21, 2**21)}
        np.lib.format.write_array_header_1_0(header, shape)
        archive.writestr("W_q.npy", header.getvalue() + bytes(64))
    with pytest.raises(ValueError) as info:
        load_weights(path)
    assert str(info.value).startswith(f"{str(path)!r} is not a valid .npz file (truncated or ")


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_missing_files_and_directories_are_os_errors(tmp_path, suffix):
    with pytest.raises(FileNotFoundError):
        load_weights(tmp_path / f"none{suffix}")
    with pytest.raises(FileNotFoundError):
        save_weights(tmp_path / "none" / f"weights{suffix}", init_weights(4))


def test_grouped_heads_and_head_dim_shapes():
    kernels = {"W_q": (5, 12), "W_k": (10, 6), "W_v": (10, 6), "W_o": (12, 10)}
    biases = {"b_q": (12,), "b_k": (6,), "b_v": (6,), "b_o": (10,)}
    shapes = weight_shapes(10, num_heads=4, num_kv_heads=2, head_dim=3, query_size=5, bias=True)
    assert shapes == {**kernels, **biases}
    # Multi-head attention with the default head size needs no head layout.
    assert weight_shapes(8, num_heads=2) == weight_shapes(8)


def test_grouped_weights_load_strictly():
    weights = init_weights(10, num_heads=4, num_kv_heads=2, head_dim=3, bias=True, seed=1)
    _, config = check_weights(weights, num_heads=4, num_kv_heads=2, head_dim=3)
    assert (config.num_hiddens, config.query_features, config.kv_features) == (10, 12, 6)
    assert check_weights(weights)[1] == config  # any layout: widths read from the kernels
    with pytest.raises(ValueError, match=r"weights\['W_k'\] must have shape \(10, 3\)"):
        check_weights(weights, num_heads=4, num_kv_heads=1, head_dim=3)
    bad = {**weights, "W_v": np.zeros((10, 9), np.float32)}
    with pytest.raises(ValueError, match=r"weights\['W_v'\] must have shape \(10, 6\)"):
        check_weights(bad)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
        init_weights(12, num_heads=4, num_kv_heads=3)
