"""Attention sinks in the spec: the reference against a loop, hidden rows, gradients, the cache.

The loop (``naive_forward``) is written from the rule of docs "Positions and
biases" (the row's masked scores and the head's sink logit, one softmax, the
sink's column dropped), one example, head, query and key at a time.
"""

from __future__ import annotations

import numpy as np
import pytest
from finite_differences import assert_central_differences
from test_spec_positions import cached_setup, naive_forward, reference_step, setup

from mha_multi import spec
from mha_multi.heads import prune_heads
from mha_multi.parity.decode import decode, random_schedule
from mha_multi.weights import check_weights, init_weights, load_weights, save_weights, weight_shapes

OPS = spec.NumpyOps()


def with_sinks(weights, num_heads, seed):
    logits = np.random.default_rng(seed).standard_normal(num_heads) * 2.0
    return {**weights, "sinks": logits}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"causal": True, "window": None, "valid_lens": np.array([3, 5])},
        {"causal": True, "window": 2, "valid_lens": None},
    ],
    ids=["causal lengths", "window"],
)
def test_reference_matches_a_loop(kwargs):
    weights, inputs, _ = setup(20)
    weights = with_sinks(weights, 4, 20)
    lens = kwargs.pop("valid_lens")
    got = spec.reference_forward(weights, *inputs.values(), lens, num_heads=4, sinks=True, **kwargs)
    expected = naive_forward(weights, *inputs.values(), lens, num_heads=4, sinks=True, **kwargs)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    # The keys' weights sum to less than 1: the sink takes the rest.
    assert (got[1].sum(-1) < 1).all()


def test_a_fully_hidden_row_puts_its_weight_on_the_sink():
    weights, inputs, _ = setup(21, num_queries=3, num_keys=4)
    weights = with_sinks(weights, 4, 21)
    output, attention = spec.reference_forward(
        weights, *inputs.values(), np.array([[0, 2, 0], [4, 0, 1]]), num_heads=4, sinks=True
    )
    hidden = [(0, 0), (0, 2), (1, 1)]
    for b, i in hidden:
        assert (attention[b, :, i] == 0).all()
        np.testing.assert_array_equal(output[b, i], 0.0)  # no bias: W_o of a zero context
    assert (attention[0, :, 1].sum(-1) > 0).all()


def test_no_key_gives_a_zero_context_and_empty_weights():
    weights, inputs, _ = setup(22, num_keys=0)
    weights = with_sinks(weights, 4, 22)
    output, attention = spec.reference_forward(weights, *inputs.values(), num_heads=4, sinks=True)
    assert attention.shape == (2, 4, 5, 0)
    np.testing.assert_array_equal(output, 0.0)


def test_non_finite_scores_propagate_to_their_row():
    weights, inputs, _ = setup(23)
    weights = with_sinks(weights, 4, 23)
    inputs["keys"][0, 1, 0] = np.nan
    output, _ = spec.reference_forward(
        weights, *inputs.values(), np.array([5, 5]), num_heads=4, sinks=True
    )
    assert np.isnan(output[0]).all() and np.isfinite(output[1]).all()
    # A hidden key's NaN score is replaced: the rows that do not see it stay finite.
    output, _ = spec.reference_forward(
        weights, *inputs.values(), np.array([1, 5]), num_heads=4, sinks=True
    )
    assert np.isfinite(output).all()


def test_16_bit_softmax_runs_in_float32_with_the_logits():
    rng = np.random.default_rng(24)
    scores = rng.standard_normal((1, 2, 3, 4)).astype(np.float16)
    sinks = np.array([0.5, -1.0], np.float16)
    got = spec.masked_softmax(OPS, scores, None, sinks=sinks)
    exact, _ = spec.sink_weights(scores.astype(np.float64), sinks.astype(np.float64))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, exact.astype(np.float32).astype(np.float16))


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_reference_gradients_match_finite_differences(num_kv_heads):
    weights, inputs, rng = setup(25, bias=True, num_kv_heads=num_kv_heads)
    weights = with_sinks(weights, 4, 25)
    lens = np.array([[5, 0, 2, 5, 1], [3, 3, 0, 4, 5]])  # fully hidden rows included
    cotangent = rng.standard_normal((2, 5, 16))
    arrays = {**inputs, **weights}
    kwargs = {"num_heads": 4, "num_kv_heads": num_kv_heads, "sinks": True, "softcap": 2.0}

    def loss():
        args = [arrays[name] for name in ("queries", "keys", "values")]
        out, _ = spec.reference_forward({n: arrays[n] for n in weights}, *args, lens, **kwargs)
        return float(np.sum(out * cotangent))

    grads = spec.reference_gradients(
        weights, *inputs.values(), lens, output_gradient=cotangent, **kwargs
    )
    assert set(grads) == set(arrays)
    assert np.abs(grads["sinks"]).min() > 0
    assert_central_differences(grads, arrays, loss, rng=rng, entries=6)


def test_cached_chunks_equal_one_full_call():
    weights, inputs, lengths, rng = cached_setup(26, 2)
    weights = with_sinks(weights, 4, 26)
    heads = spec.heads_of_weights(weights, 4, num_kv_heads=2)
    options = {"sinks": True, "window": 3}
    full, _ = spec.reference_forward(
        weights, *inputs.values(), lengths, num_heads=4, causal=True, **options
    )
    expected = np.where((np.arange(7) < lengths[:, None])[..., None], full, 0.0)
    step = reference_step(weights, heads, 9, **options)
    got = decode(step, inputs, lengths, random_schedule(rng, lengths))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def test_the_spec_cached_call_is_the_cached_reference():
    weights, inputs, _, _ = cached_setup(27, 4)
    weights = with_sinks(weights, 4, 27)
    heads = spec.heads_of_weights(weights, 4)
    shape = spec.cache_shape(3, 5, heads)
    cache = spec.KVCache(np.zeros(shape), np.zeros(shape), np.array([0, 2, 5], np.int32))
    rows = [x[:, :2] for x in inputs.values()]
    new_lens = np.array([2, 1, 0], np.int32)
    output, attention, _ = spec.reference_cached_forward(
        weights, *rows, cache, new_lens, num_heads=4, causal=True, sinks=True
    )
    q, k, v = (x @ weights[f"W_{n}"] for x, n in zip(rows, "qkv", strict=True))
    updated, lens = spec.update_cache(OPS, cache, k, v, new_lens, head_dim=4, causal=True)
    options = spec.LayerOptions(sinks=True).score_options(num_heads=4)
    options = options.with_sinks(weights["sinks"])
    context, expected = spec.attention(
        OPS,
        q,
        updated.keys,
        updated.values,
        lens,
        num_heads=4,
        head_dim=4,
        kv_split=True,
        options=options,
    )
    np.testing.assert_allclose(attention, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(output, context @ weights["W_o"], rtol=0, atol=1e-12)
    # The third example's cache is empty and it appends nothing: its rows see no key.
    np.testing.assert_array_equal(output[2], 0.0)


def test_the_option_and_the_weight_go_together():
    weights, inputs, _ = setup(28)
    with pytest.raises(ValueError, match="missing 'sinks'"):
        spec.reference_forward(weights, *inputs.values(), num_heads=4, sinks=True)
    with pytest.raises(ValueError, match="'sinks'"):
        spec.reference_forward(with_sinks(weights, 4, 0), *inputs.values(), num_heads=4)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        spec.reference_forward(with_sinks(weights, 3, 0), *inputs.values(), num_heads=4, sinks=True)
    with pytest.raises(TypeError, match="sinks must be a bool"):
        spec.LayerOptions.of({"sinks": "yes"})
    assert spec.LayerOptions.of({"sinks": True}).config()["sinks"] is True
    assert not spec.LayerOptions.of({"sinks": True}).is_default


def test_a_layer_with_sinks_takes_the_generic_path():
    kernel = spec.FusedKernel("any", takes_bias=True, takes_softcap=True, takes_window=True)
    plan = spec.plan_kernel(kernel, sizes=(2, 3, 3), lens_ndim=None, values_exact=True, sinks=True)
    assert not plan.fused and "sinks" in plan.reason


# -- canonical weights and heads -----------------------------------------------


def grouped_weights(**kwargs):
    return init_weights(16, num_heads=4, num_kv_heads=2, head_dim=4, sinks=True, **kwargs)


def test_the_sinks_entry_is_optional_zeros_and_strict():
    weights = grouped_weights(bias=True)
    assert weights["sinks"].shape == (4,) and (weights["sinks"] == 0).all()
    # The other entries draw as they do without sinks.
    plain = init_weights(16, num_heads=4, num_kv_heads=2, head_dim=4, bias=True)
    assert all(np.array_equal(plain[name], weights[name]) for name in plain)
    heads = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 4}
    _, config = check_weights(weights, **heads, sinks=True)
    assert config.sinks
    with pytest.raises(ValueError, match=r"unexpected entry 'sinks' \(the layer has sinks=False\)"):
        check_weights(weights, **heads)
    with pytest.raises(ValueError, match=r"missing 'sinks' \(sinks=True\)"):
        check_weights(plain, **heads, sinks=True)
    with pytest.raises(ValueError, match=r"weights\['sinks'\] must have shape \(4,\)"):
        check_weights({**weights, "sinks": np.zeros(2, np.float32)}, **heads, sinks=True)
    with pytest.raises(ValueError, match=r"weights\['sinks'\] must be \(num_heads,\)"):
        check_weights({**weights, "sinks": np.zeros(3, np.float32)}, sinks=None)
    with pytest.raises(TypeError, match="sinks"):
        check_weights({**weights, "sinks": np.zeros(4, np.int32)}, **heads, sinks=True)
    with pytest.raises(ValueError, match="needs num_heads"):
        weight_shapes(16, sinks=True)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_files_keep_the_sinks_bit_for_bit(tmp_path, suffix):
    weights = grouped_weights()
    weights["sinks"] = np.random.default_rng(29).standard_normal(4).astype(np.float32)
    save_weights(tmp_path / f"w{suffix}", weights)
    loaded = load_weights(tmp_path / f"w{suffix}")
    assert sorted(loaded) == sorted(weights)
    assert all(loaded[name].tobytes() == weights[name].tobytes() for name in weights)


def test_a_pruned_layer_keeps_its_heads_sinks_and_is_the_masked_one():
    weights, inputs, _ = setup(30, num_kv_heads=2)
    weights = with_sinks(weights, 4, 30)
    pruned, config = prune_heads(weights, [0, 1], num_heads=4, num_kv_heads=2)
    np.testing.assert_array_equal(pruned["sinks"], weights["sinks"][2:])
    assert config.sinks and config.kwargs()["sinks"] is True
    lens = np.array([[5, 0, 2, 5, 1], [3, 3, 0, 4, 5]])
    kwargs = {"causal": True, "sinks": True}
    small, _ = spec.reference_forward(pruned, *inputs.values(), lens, num_heads=2, **kwargs)
    masked, _ = spec.reference_forward(
        weights, *inputs.values(), lens, num_heads=4, head_mask=np.array([0.0, 0, 1, 1]), **kwargs
    )
    np.testing.assert_allclose(small, masked, rtol=0, atol=1e-12)
