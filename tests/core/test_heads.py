"""Head masks and pruning in the spec: against per-head loops and finite differences."""

from __future__ import annotations

import numpy as np
import pytest

from mha_multi import spec
from mha_multi.heads import LayerConfig, importance, prune_heads
from mha_multi.weights import init_weights

LAYOUTS = {
    "mha": {"num_heads": 4},
    "gqa": {"num_heads": 4, "num_kv_heads": 2},
    "head_dim": {"num_heads": 3, "head_dim": 5},
}


def _inputs(seed: int, batch: int = 2, num_queries: int = 3, num_keys: int = 4):
    rng = np.random.default_rng(seed)
    sizes = {"queries": 6, "keys": 8, "values": 7}
    length = {"queries": num_queries, "keys": num_keys, "values": num_keys}
    return rng, [rng.standard_normal((batch, length[k], s)) for k, s in sizes.items()]


def _weights(layout: dict, seed: int, bias: bool = True):
    weights = init_weights(
        12, bias=bias, seed=seed, query_size=6, key_size=8, value_size=7, **layout
    )
    # float64, so that finite differences of 1e-6 are not lost to rounding.
    return {name: value.astype(np.float64) for name, value in weights.items()}


def _per_head_loop(weights, inputs, lens, num_heads, num_kv_heads, gates):
    """Each head on its own, gated, then ``W_o``: the rule of the docs, written out."""
    queries, keys, values = inputs
    dh = weights["W_q"].shape[1] // num_heads
    group = num_heads // num_kv_heads

    def project(x, name):
        return x @ weights[f"W_{name}"] + weights.get(f"b_{name}", 0)

    q, k, v = project(queries, "q"), project(keys, "k"), project(values, "v")
    output = np.zeros((q.shape[0], q.shape[1], weights["W_o"].shape[1])) + weights.get("b_o", 0)
    for b in range(q.shape[0]):
        for h in range(num_heads):
            j = h // group
            qh, kh, vh = (
                q[b, :, h * dh : (h + 1) * dh],
                k[b, :, j * dh : (j + 1) * dh],
                v[b, :, j * dh : (j + 1) * dh],
            )
            scores = qh @ kh.T / np.sqrt(dh)
            scores = np.where(np.arange(kh.shape[0]) < lens[b], scores, spec.MASK_VALUE)
            attn = np.exp(scores - scores.max(-1, keepdims=True))
            attn /= attn.sum(-1, keepdims=True)
            gate = gates[h] if gates.ndim == 1 else gates[b, h]
            output[b] += gate * (attn @ vh) @ weights["W_o"][h * dh : (h + 1) * dh]
    return output


def _gated(name: str, seed: int, per_example: bool, low: float, high: float):
    """A layout's weights (seed ``seed``) and inputs (``seed + 1``), and gates
    from ``U(low, high)``: one per head, or one per example and head."""
    layout = LAYOUTS[name]
    weights = _weights(layout, seed)
    rng, inputs = _inputs(seed + 1)
    num_heads = layout["num_heads"]
    gates = rng.uniform(low, high, (2, num_heads) if per_example else (num_heads,))
    return layout, weights, rng, inputs, gates


@pytest.mark.parametrize("per_example", [False, True])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_head_mask_gates_each_heads_context(name, per_example):
    layout, weights, _, inputs, gates = _gated(name, 1, per_example, -1, 2)
    num_heads = layout["num_heads"]
    lens = np.array([3, 1])
    output, _ = spec.reference_forward(weights, *inputs, lens, **_heads(layout), head_mask=gates)
    kv_heads = layout.get("num_kv_heads", num_heads)
    expected = _per_head_loop(weights, inputs, lens, num_heads, kv_heads, gates)
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-12)


def _heads(layout: dict) -> dict:
    return {k: v for k, v in layout.items() if k != "head_dim"}


def _finite_differences(function, value: np.ndarray, step: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(value)
    for index in np.ndindex(value.shape):
        plus, minus = value.copy(), value.copy()
        plus[index] += step
        minus[index] -= step
        grad[index] = (function(plus) - function(minus)) / (2 * step)
    return grad


@pytest.mark.parametrize("per_example", [False, True])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_head_mask_gradients_are_the_finite_differences(name, per_example):
    layout, weights, rng, inputs, gates = _gated(name, 3, per_example, 0, 1)
    lens = np.array([[1, 4, 2], [0, 3, 4]])
    output_gradient = rng.standard_normal((2, 3, 12))
    kwargs = {**_heads(layout), "causal": True}
    grads = spec.reference_gradients(
        weights, *inputs, lens, output_gradient=output_gradient, head_mask=gates, **kwargs
    )

    def loss(**changed):
        arguments = {"weights": weights, "inputs": inputs, "gates": gates, **changed}
        output, _ = spec.reference_forward(
            arguments["weights"], *arguments["inputs"], lens, head_mask=arguments["gates"], **kwargs
        )
        return float(np.sum(output * output_gradient))

    expected = _finite_differences(lambda g: loss(gates=g), gates)
    np.testing.assert_allclose(grads["head_mask"], expected, rtol=0, atol=1e-7)
    for weight in ("W_q", "W_o", "b_v"):

        def loss_of(value, weight=weight):
            return loss(weights={**weights, weight: value})

        expected = _finite_differences(loss_of, weights[weight])
        np.testing.assert_allclose(grads[weight], expected, rtol=0, atol=1e-7, err_msg=weight)
    expected = _finite_differences(lambda x: loss(inputs=[inputs[0], x, inputs[2]]), inputs[1])
    np.testing.assert_allclose(grads["keys"], expected, rtol=0, atol=1e-7)


def test_without_a_head_mask_nothing_changes():
    weights = _weights(LAYOUTS["gqa"], 5)
    _, inputs = _inputs(6)
    plain = spec.reference_forward(weights, *inputs, num_heads=4)[0]
    ones = spec.reference_forward(weights, *inputs, num_heads=4, head_mask=np.ones(4))[0]
    np.testing.assert_array_equal(plain, ones)
    grads = spec.reference_gradients(weights, *inputs, num_heads=4, output_gradient=plain)
    assert "head_mask" not in grads


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (np.ones(3), ValueError, r"\(num_heads,\) = \(4,\) or \(batch, num_heads\) = \(2, 4\)"),
        (np.ones((2, 4, 1)), ValueError, "head_mask must have shape"),
        (np.ones(4, dtype=np.int64), TypeError, "head_mask must be a floating-point"),
    ],
)
def test_bad_head_masks_are_named(mask, error, match):
    weights = _weights(LAYOUTS["mha"], 0)
    _, inputs = _inputs(0)
    with pytest.raises(error, match=match):
        spec.reference_forward(weights, *inputs, num_heads=4, head_mask=mask)


@pytest.mark.parametrize(
    ("name", "removed"),
    [
        ("mha", [1]),
        ("mha", [0, 2, 3]),
        ("mha", []),
        ("gqa", [2, 3]),
        ("gqa", [0, 1]),
        ("head_dim", [0, 2]),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_a_pruned_layer_is_the_masked_one(name, removed, bias):
    layout = LAYOUTS[name]
    weights = _weights(layout, 7, bias)
    _, inputs = _inputs(8)
    lens = np.array([4, 2])
    gates = np.ones(layout["num_heads"])
    gates[removed] = 0.0
    masked = spec.reference_forward(weights, *inputs, lens, **_heads(layout), head_mask=gates)[0]
    pruned, config = prune_heads(weights, removed, **layout)
    assert isinstance(config, LayerConfig)
    assert config.num_heads == layout["num_heads"] - len(removed)
    assert config.head_dim == weights["W_q"].shape[1] // layout["num_heads"]
    output = spec.reference_forward(
        pruned, *inputs, lens, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads
    )[0]
    np.testing.assert_allclose(output, masked, rtol=0, atol=1e-12)
    kv_heads = layout.get("num_kv_heads", layout["num_heads"])
    expected_kv = kv_heads - len(removed) // (layout["num_heads"] // kv_heads)
    assert config.num_kv_heads == expected_kv
    assert pruned["W_k"].shape == (8, expected_kv * config.head_dim)
    assert config.kwargs()["query_size"] == 6 and config.bias == bias


@pytest.mark.parametrize(
    ("name", "removed", "error", "match"),
    [
        ("mha", [0, 1, 2, 3], ValueError, "every head"),
        ("gqa", [1], ValueError, r"query heads \[0, 1\] share key/value head 0"),
        ("gqa", [1, 2], ValueError, "share key/value head 0"),
        ("mha", [4], ValueError, "out of range"),
        ("mha", [-1], ValueError, "out of range"),
        ("mha", [1, 1], ValueError, "must not repeat"),
        ("mha", [1.0], TypeError, "must be ints"),
        ("mha", 1, TypeError, "heads must be an iterable of ints; got int"),
        ("mha", "12", TypeError, "heads must be an iterable of ints; got str"),
    ],
)
def test_bad_pruning_is_named(name, removed, error, match):
    layout = LAYOUTS[name]
    with pytest.raises(error, match=match):
        prune_heads(_weights(layout, 0), removed, **layout)


def test_head_dim_is_checked_against_the_weights():
    with pytest.raises(ValueError, match="head_dim"):
        prune_heads(_weights(LAYOUTS["mha"], 0), [0], num_heads=4, head_dim=5)


def test_a_cached_call_gates_its_heads_as_the_full_forward_does():
    weights = _weights(LAYOUTS["gqa"], 9)
    _, (queries, keys, values) = _inputs(10, num_queries=4, num_keys=4)
    gates = np.array([[1.0, 0.0, 0.5, 2.0], [0.0, 1.0, 1.0, -1.0]])
    shape = spec.cache_shape(2, 6, spec.heads_of_weights(weights, 4))
    cache = spec.KVCache(np.zeros(shape), np.zeros(shape), np.zeros(2, np.int32))
    cached, _, _ = spec.reference_cached_forward(
        weights, queries, keys, values, cache, num_heads=4, causal=True, head_mask=gates
    )
    full, _ = spec.reference_forward(
        weights, queries, keys, values, num_heads=4, causal=True, head_mask=gates
    )
    np.testing.assert_allclose(cached, full, rtol=0, atol=1e-12)


def test_importance_is_the_mean_gradient_over_its_norm():
    """Hand-computed: |g| averaged over batches, over its L2 norm; zeros stay zeros, and a
    NaN makes every normalized importance NaN (its finite ones were left unnormalized)."""
    gradients = [np.array([3.0, -4.0, 0.0]), np.array([-3.0, 4.0, 0.0])]
    np.testing.assert_array_equal(importance(gradients), [0.6, 0.8, 0.0])
    np.testing.assert_array_equal(importance(gradients, normalize=False), [3.0, 4.0, 0.0])
    np.testing.assert_array_equal(importance([np.zeros(3)]), np.zeros(3))
    with_nan = [np.array([3.0, np.nan, 4.0])]
    assert np.isnan(importance(with_nan)).all()
    np.testing.assert_array_equal(importance(with_nan, normalize=False), [3.0, np.nan, 4.0])
