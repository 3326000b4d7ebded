"""Canonical weights: shapes, seeded init, strict checks, bit-exact files."""

from __future__ import annotations

import numpy as np
import pytest

from mha_multi.weights import check_weights, init_weights, load_weights, save_weights, weight_shapes


def test_shapes():
    assert weight_shapes(8, query_size=3, key_size=4, value_size=5, bias=True) == {
        "W_q": (3, 8),
        "W_k": (4, 8),
        "W_v": (5, 8),
        "W_o": (8, 8),
        "b_q": (8,),
        "b_k": (8,),
        "b_v": (8,),
        "b_o": (8,),
    }
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
        (lambda w: w.update(W_o=np.zeros((8, 9), np.float32)), {}, r"W_o'\] must have shape"),
        (
            lambda w: w.update(W_q=np.zeros((5, 8), np.float32)),
            {"query_size": 8},
            r"W_q'\] must have shape \(8, 8\)",
        ),
        (lambda w: w.update(W_v=np.zeros(8, np.float32)), {}, "must be 2-D"),
    ],
)
def test_check_is_strict(edit, kwargs, match):
    weights = init_weights(8, bias=kwargs.get("bias", False))
    edit(weights)
    with pytest.raises(ValueError, match=match):
        check_weights(weights, **kwargs)


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
    with pytest.raises(ValueError):
        load_weights(path)
