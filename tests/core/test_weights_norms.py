"""The query/key norms' canonical entries ``q_norm``, ``k_norm``: strict, carried by files and
by ``convert``, kept by pruning per head and refused for a whole-projection norm."""

from __future__ import annotations

import numpy as np
import pytest

from mha_multi import spec
from mha_multi.__main__ import convert
from mha_multi.heads import prune_heads
from mha_multi.weights import check_weights, init_weights, load_weights, save_weights

LAYOUT = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 3}


def with_norms(scope="heads", seed=0):
    weights = init_weights(10, bias=True, seed=seed, **LAYOUT)
    shapes = spec.QKNorm(scope=scope).shapes(spec.Heads(4, 2, 3))
    rng = np.random.default_rng(seed)
    weights.update({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()})
    return weights


@pytest.mark.parametrize(
    ("change", "qk_norm", "match"),
    [
        (lambda w: w.pop("k_norm"), "heads", r"missing 'k_norm' \(qk_norm scope 'heads'\)"),
        (lambda w: w.pop("k_norm"), None, "has 'q_norm' but is missing 'k_norm'"),
        (lambda w: None, False, "unexpected entry 'k_norm' \\(the layer has no qk_norm\\)"),
        (lambda w: w.update(q_norm=np.ones(12, np.float32)), "heads", r"q_norm'\] must have"),
        (lambda w: w.update(k_norm=np.ones(4, np.float32)), "heads", r"k_norm'\] must have"),
        (lambda w: None, "whole", r"q_norm'\] must have shape \(12,\)"),
    ],
    ids=["missing", "missing, inferred", "extra", "q shape", "k shape", "scope"],
)
def test_loading_is_strict_about_the_norms(change, qk_norm, match):
    weights = with_norms()
    change(weights)
    with pytest.raises(ValueError, match=match):
        check_weights(weights, qk_norm=qk_norm, **LAYOUT)


@pytest.mark.parametrize("scope", ["heads", "whole"])
def test_either_scope_is_read_without_a_layout(scope):
    weights = with_norms(scope)
    arrays, _ = check_weights(weights, qk_norm=None)
    assert set(spec.QK_NORM_NAMES) <= set(arrays)
    check_weights(weights, qk_norm=scope, **LAYOUT)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_files_round_trip_the_norms_bit_exact(tmp_path, suffix):
    weights = with_norms("whole")
    path = tmp_path / f"w{suffix}"
    save_weights(path, weights)
    loaded = load_weights(path)
    assert set(loaded) == set(weights)
    for name, array in weights.items():
        np.testing.assert_array_equal(loaded[name], array)


def test_convert_carries_the_norms_to_llama_and_back(tmp_path):
    pytest.importorskip("torch")
    weights = with_norms()
    weights = init_weights(12, bias=False, **LAYOUT) | {
        k: v for k, v in weights.items() if k in spec.QK_NORM_NAMES
    }
    source = tmp_path / "w.npz"
    save_weights(source, weights)
    convert(source, tmp_path / "block.safetensors", num_heads=4, destination_format="llama")
    back = convert(tmp_path / "block.safetensors", tmp_path / "back.npz", num_heads=4)
    for name, array in weights.items():
        np.testing.assert_array_equal(back[name], array)


def test_pruning_keeps_per_head_norms_and_refuses_whole_ones():
    weights = with_norms()
    pruned = prune_heads(weights, [0, 1], **LAYOUT)
    for name in spec.QK_NORM_NAMES:
        np.testing.assert_array_equal(pruned.weights[name], weights[name])
    # The pruned layer is the full one with those heads gated off.
    x = np.random.default_rng(1).standard_normal((2, 3, 10))
    options = {"causal": True, "qk_norm": spec.QKNorm()}
    gated, _ = spec.reference_forward(
        weights, x, x, x, num_heads=4, head_mask=np.array([0.0, 0.0, 1.0, 1.0]), **options
    )
    smaller, _ = spec.reference_forward(pruned.weights, x, x, x, num_heads=2, **options)
    np.testing.assert_allclose(smaller, gated, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="pruning heads is not possible with qk_norm"):
        prune_heads(with_norms("whole"), [0, 1], **LAYOUT)
