"""The query/key norms (``qk_norm=``) of the spec: the option, the float64 reference, its gradient.

The reference is checked against a loop written from the families' formula
(``g * x / sqrt(mean(x ** 2) + eps)``, each head or the whole projection at
a time), its gradient against central differences, and a cached call
against one full forward.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from finite_differences import assert_central_differences
from test_spec_positions import loop_norm, reference_step

from mha_multi import spec
from mha_multi.parity.decode import decode, random_schedule
from mha_multi.weights import init_weights

HEADS = spec.Heads(num_heads=4, num_kv_heads=2, head_dim=4)
NORMS = {
    "qwen3": {"eps": 1e-6},
    "gemma3": {"unit_offset": True, "product": "float32"},
    "olmo2": {"scope": "whole", "eps": 1e-5, "product": "float32"},
}


def setup(name, seed=0, *, bias=True, length=5):
    """Weights of 12 hiddens over ``HEADS`` with norms, self-attention inputs, the norm."""
    rng = np.random.default_rng(seed)
    norm = spec.QKNorm(**NORMS[name])
    weights = init_weights(12, num_heads=4, num_kv_heads=2, head_dim=4, bias=bias, seed=seed)
    weights = {k: v.astype(np.float64) for k, v in weights.items()}
    for key, shape in norm.shapes(HEADS).items():
        weights[key] = norm.initial_value + 0.5 * rng.standard_normal(shape)
    x = rng.standard_normal((3, length, 12))
    return weights, x, norm, rng


@pytest.mark.parametrize("name", list(NORMS))
def test_reference_forward_is_the_norm_then_the_layer(name):
    """With the norms written out by a loop, the layer without them is the layer with them."""
    weights, x, norm, _ = setup(name)
    rotary = {"theta": 100.0}
    got, _ = spec.reference_forward(
        weights, x, x, x, num_heads=4, causal=True, qk_norm=norm, rotary=rotary
    )
    size = HEADS.head_dim if norm.scope == "heads" else None
    plain = {k: v for k, v in weights.items() if k not in spec.QK_NORM_NAMES}
    q = loop_norm(x @ weights["W_q"] + weights["b_q"], weights["q_norm"], norm, size or 16)
    k = loop_norm(x @ weights["W_k"] + weights["b_k"], weights["k_norm"], norm, size or 8)
    # The normalised projections as the projections of a layer without norms (W = I).
    eye = {"W_q": np.eye(16), "W_k": np.eye(8), "b_q": 0 * plain["b_q"], "b_k": 0 * plain["b_k"]}
    v_input = x @ weights["W_v"] + weights["b_v"]
    expected, _ = spec.reference_forward(
        {**plain, **eye, "W_v": np.eye(8), "b_v": 0 * plain["b_v"]},
        q,
        k,
        v_input,
        num_heads=4,
        causal=True,
        rotary=rotary,
    )
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(NORMS))
def test_reference_gradients_match_finite_differences(name):
    weights, x, norm, rng = setup(name, seed=1, length=4)
    arrays = {**weights, "queries": x.copy(), "keys": x.copy(), "values": x.copy()}
    output_gradient = rng.standard_normal((3, 4, 12))
    options = {"num_heads": 4, "causal": True, "qk_norm": norm, "rotary": {"theta": 100.0}}

    def loss():
        w = {k: arrays[k] for k in weights}
        output, _ = spec.reference_forward(
            w, arrays["queries"], arrays["keys"], arrays["values"], **options
        )
        return float((output * output_gradient).sum())

    grads = spec.reference_gradients(weights, x, x, x, output_gradient=output_gradient, **options)
    assert set(spec.QK_NORM_NAMES) <= set(grads)
    assert_central_differences(grads, arrays, loss, rng=rng, entries=4, atol=1e-7)


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("shape", [(3, 4, 0), (3, 0, 4), (0, 4, 4)], ids=["K=0", "Q=0", "B=0"])
def test_reference_gradients_of_an_empty_axis(name, shape):
    """As the edge cases say (docs: "Edge cases"): ``b_o`` gets the sum of the output
    gradient, every other gradient is zero. Per-head norms of an empty batch or of no
    queries raised numpy's ``cannot reshape`` (a ``-1`` among zero sizes)."""
    weights, _, norm, rng = setup(name)
    batch, num_queries, num_keys = shape
    x = rng.standard_normal((batch, num_queries, 12))
    y = rng.standard_normal((batch, num_keys, 12))
    output_gradient = rng.standard_normal((batch, num_queries, 12))
    grads = spec.reference_gradients(
        weights, x, y, y, output_gradient=output_gradient, num_heads=4, qk_norm=norm
    )
    for key, value in grads.items():
        expected = output_gradient.sum(axis=(0, 1)) if key == "b_o" else 0.0
        np.testing.assert_array_equal(value, np.broadcast_to(expected, value.shape), err_msg=key)


@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_cached_chunks_equal_one_full_call(name):
    """Keys are normalised before they enter the cache: any split gives one causal forward."""
    weights, x, norm, rng = setup(name, seed=2, length=7)
    lengths = np.array([7, 4, 1])
    options = {"qk_norm": norm, "rotary": {"theta": 100.0}}
    full, _ = spec.reference_forward(weights, x, x, x, lengths, num_heads=4, causal=True, **options)
    expected = np.where((np.arange(7) < lengths[:, None])[..., None], full, 0.0)
    step = reference_step(weights, HEADS, 8, **options)
    inputs = {"queries": x, "keys": x, "values": x}
    got = decode(step, inputs, lengths, random_schedule(rng, lengths))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def test_norms_run_in_float32_and_round_once():
    """16-bit projections are normalised in float32; the product where the option says."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8)).astype(np.float16)
    weight = (1 + 0.5 * rng.standard_normal(4)).astype(np.float16)
    ops = spec.NumpyOps()
    wide = x.astype(np.float32).reshape(2, 3, 2, 4)
    normed = wide / np.sqrt((wide * wide).mean(-1, keepdims=True) + np.float32(1e-6))
    input_product = (normed.astype(np.float16) * weight).reshape(2, 3, 8)
    float32_product = (normed * weight.astype(np.float32)).astype(np.float16).reshape(2, 3, 8)
    for product, expected in (("input", input_product), ("float32", float32_product)):
        norm = spec.QKNorm(product=product)
        got = spec.rms_norm(ops, x, weight, norm, 2, 4)
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float32), expected, rtol=0, atol=2e-3)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_query_and_key_heads_normalised_in_one_pass_are_each_norms_numbers(name, dtype):
    """The query and key heads stacked, normalised at once (``rms_normalized``) and each
    given its weight (``rms_gain``): the families' formula, and each norm's numbers alone
    (``rms_norm``) to the bit, which PyTorch's fast route relies on."""
    rng = np.random.default_rng(5)
    norm = spec.QKNorm(**NORMS[name])
    ops = spec.NumpyOps()
    q = (3 * rng.standard_normal((2, 3, 4 * 8))).astype(dtype)
    k = (3 * rng.standard_normal((2, 3, 2 * 8))).astype(dtype)
    q_weight, k_weight = (
        (norm.initial_value + 0.5 * rng.standard_normal(8)).astype(dtype) for _ in "qk"
    )
    normed = spec.rms_normalized(ops, np.concatenate([q, k], -1), norm, 6, 8)
    got = [
        spec.rms_gain(ops, part, weight, norm, dtype).reshape(2, 3, -1)
        for part, weight in ((normed[:, :, :4], q_weight), (normed[:, :, 4:], k_weight))
    ]
    for part, x, weight, heads in zip(got, (q, k), (q_weight, k_weight), (4, 2), strict=True):
        assert part.dtype == dtype
        np.testing.assert_array_equal(part, spec.rms_norm(ops, x, weight, norm, heads, 8))
        wide = x.astype(np.float64).reshape(2, 3, heads, 8)
        formula = wide / np.sqrt((wide * wide).mean(-1, keepdims=True) + norm.eps)
        gain = weight.astype(np.float64) + (1.0 if norm.unit_offset else 0.0)
        tol = {np.float16: 4e-3, np.float32: 2e-6, np.float64: 1e-12}[dtype]
        expected = (formula * gain).reshape(2, 3, -1)
        np.testing.assert_allclose(part.astype(np.float64), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ({"scope": "rows"}, ValueError, "qk_norm.scope"),
        ({"eps": 0.0}, ValueError, "qk_norm.eps"),
        ({"unit_offset": 1}, TypeError, "qk_norm.unit_offset"),
        ({"product": "float16"}, ValueError, "qk_norm.product"),
        ({"epsilon": 1e-6}, ValueError, r"unknown keys \['epsilon'\]"),
        ("heads", TypeError, "qk_norm must be None"),
    ],
)
def test_bad_options_are_named(value, error, match):
    with pytest.raises(error, match=match):
        spec.LayerOptions.of({"qk_norm": value})


def test_options_round_trip_as_plain_values():
    options = spec.LayerOptions.of({"qk_norm": NORMS["gemma3"], "rotary": {"theta": 10.0}})
    assert isinstance(options.qk_norm, spec.QKNorm)
    assert spec.QKNorm.__module__ == "mha_multi.spec"
    config = options.config()
    assert config["qk_norm"] == dataclasses.asdict(options.qk_norm)
    assert spec.LayerOptions.of(config) == options
    assert not options.is_default
    assert spec.QKNorm().initial_value == 1.0 and options.qk_norm.initial_value == 0.0


def test_whole_norms_refuse_head_work():
    spec.refuse_whole_norm(spec.QKNorm(), "pruning heads")  # per head: nothing to refuse
    with pytest.raises(ValueError, match="pruning heads is not possible with qk_norm"):
        spec.refuse_whole_norm(spec.QKNorm(scope="whole"), "pruning heads")
