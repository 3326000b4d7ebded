"""Weights to and from Flax's attention layers (NNX, Linen) and d2l's JAX layer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax_support import inputs

from mha_multi import spec
from mha_multi.interop.jax import (
    attention_mask,
    from_flax_linen,
    from_flax_nnx,
    from_flax_nnx_state,
    from_jax_d2l,
    to_flax_linen,
    to_flax_nnx,
    to_flax_nnx_state,
    to_jax_d2l,
)
from mha_multi.jax import MultiHeadAttention, get_weights, linen, set_weights
from mha_multi.parity.cases import CASES, OPTION_CASES
from mha_multi.parity.runners import get_runner
from mha_multi.weights import init_weights

# Every feature: lengths of each kind, causal of each alignment, fully hidden
# rows (lens_zero, lens_2d, causal_more_queries, one_key), biases. Flax's
# layers have no gates of the heads, no positions and no score options: the
# head-mask and option cases are not theirs.
NATIVE_CASES = [
    c.name
    for c in CASES
    if c.name != "cross_sizes" and c.head_mask is None and c not in OPTION_CASES
]


def mask_of(c):
    return attention_mask(
        c.valid_lens, c.config.num_queries, c.config.num_keys, causal=c.config.causal
    )


@pytest.mark.parametrize("name", NATIVE_CASES)
def test_native_layers_match_the_reference(cases, name):
    # Flax fills hidden scores with a large finite negative, so fully hidden
    # rows get uniform weights there too: every case agrees, those included.
    c = cases[name]
    q, k, v = inputs(c)
    native = to_flax_nnx(c.weights, c.config.num_heads)
    out = native(q, k, v, mask=mask_of(c), deterministic=True)
    outputs = [out]
    if c.config.num_kv_heads is None:  # Linen's layer has no grouped heads
        module, variables = to_flax_linen(c.weights, c.config.num_heads)
        outputs.append(module.apply(variables, q, k, v, mask=mask_of(c), deterministic=True))
    for got in outputs:
        np.testing.assert_allclose(got, c.reference["output"], rtol=0, atol=5e-6)
    ours = get_runner("jax-nnx").layer_for(c)
    np.testing.assert_allclose(
        ours(q, k, v, c.valid_lens, causal=c.config.causal), out, rtol=0, atol=5e-6
    )


def test_fully_hidden_rows_agree_with_the_spec(cases):
    c = cases["lens_zero"]  # valid_lens [0, -2, 3]
    q, k, v = inputs(c)
    out = to_flax_nnx(c.weights, c.config.num_heads)(q, k, v, mask=mask_of(c))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out[:2], c.reference["output"][:2], atol=5e-6)


def test_linen_takes_different_key_and_value_sizes_and_nnx_refuses_them(cases):
    c = cases["cross_sizes"]  # query/key/value sizes 7/5/3, biases
    q, k, v = inputs(c)
    module, variables = to_flax_linen(c.weights, c.config.num_heads)
    out = module.apply(variables, q, k, v, mask=mask_of(c))
    np.testing.assert_allclose(out, c.reference["output"], atol=5e-6)
    back = from_flax_linen(variables, module)
    assert all(back[n].tobytes() == c.weights[n].tobytes() for n in c.weights)
    with pytest.raises(ValueError, match="one in_kv_features.*key_size 5 and value_size 3"):
        to_flax_nnx(c.weights, c.config.num_heads)


@pytest.mark.parametrize("use_bias", [False, True])
def test_round_trips_through_native_layers_are_bit_exact(use_bias):
    native = nnx.MultiHeadAttention(
        4,
        16,
        qkv_features=24,
        out_features=24,
        use_bias=use_bias,
        decode=False,
        rngs=nnx.Rngs(3),
    )
    weights = from_flax_nnx(native)
    assert weights["W_q"].shape == (16, 24) and weights["W_o"].shape == (24, 24)
    again = to_flax_nnx(weights, 4)
    state, again_state = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (native, again))
    jax.tree.map(np.testing.assert_array_equal, state, again_state)

    module = nn.MultiHeadDotProductAttention(4, qkv_features=24, out_features=24, use_bias=use_bias)
    x = jnp.ones((1, 2, 16))
    variables = module.init(jax.random.key(0), x, jnp.ones((1, 3, 5)))
    weights = from_flax_linen(variables, module)
    assert weights["W_k"].shape == (5, 24)
    _, again_variables = to_flax_linen(weights, 4)
    jax.tree.map(np.testing.assert_array_equal, variables, again_variables)


def test_params_tree_layout_matches_flax():
    weights = init_weights(12, query_size=7, key_size=5, value_size=5, bias=True, seed=2)
    params = to_flax_nnx_state(weights, 3)
    native = to_flax_nnx(weights, 3)
    shapes = jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(native, nnx.Param)))
    assert jax.tree.map(np.shape, params) == shapes
    assert shapes["query"] == {"kernel": (7, 3, 4), "bias": (3, 4)}
    assert shapes["out"] == {"kernel": (3, 4, 12), "bias": (12,)}
    # Head h owns columns [h*head_dim, (h+1)*head_dim) in both layouts.
    np.testing.assert_array_equal(params["key"]["kernel"][:, 1, :], weights["W_k"][:, 4:8])
    np.testing.assert_array_equal(params["out"]["kernel"][2], weights["W_o"][8:12])


def _scaled_attention(query, key, value, **kwargs):
    return nnx.dot_product_attention(query * 2.0, key, value, **kwargs)


def test_unsupported_native_options_are_refused():
    with pytest.raises(ValueError, match="normalize_qk"):
        from_flax_nnx(
            nnx.MultiHeadAttention(2, 8, normalize_qk=True, decode=False, rngs=nnx.Rngs(0))
        )
    # An attention function or products of the module's own compute something else.
    for options in ({"attention_fn": _scaled_attention}, {"qkv_dot_general": jax.lax.dot_general}):
        option = next(iter(options))
        native = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0), **options)
        with pytest.raises(ValueError, match=f"unsupported Flax attention option: {option}="):
            from_flax_nnx(native)
        with pytest.raises(ValueError, match=f"unsupported Flax attention option: {option}="):
            to_flax_nnx(init_weights(8, bias=True), 2, **options)
        module = nn.MultiHeadDotProductAttention(2, **options)
        with pytest.raises(ValueError, match=f"unsupported Flax attention option: {option}="):
            from_flax_linen(module.init(jax.random.key(0), jnp.ones((1, 2, 8))), module)
        with pytest.raises(ValueError, match=f"unsupported Flax attention option: {option}="):
            to_flax_linen(init_weights(8, bias=True), 2, **options)
    linen_module = nn.MultiHeadDotProductAttention(2)
    with pytest.raises(TypeError, match="module must be a flax.nnx.MultiHeadAttention"):
        from_flax_nnx(linen_module)
    with pytest.raises(TypeError, match="module must be a flax.linen.MultiHeadDotProductAttention"):
        from_flax_linen({"params": {}}, "x")
    grouped = init_weights(8, num_heads=4, num_kv_heads=2, seed=1)
    with pytest.raises(ValueError, match="no grouped key/value heads"):
        to_flax_linen(grouped, 4)
    module = nn.MultiHeadDotProductAttention(2, normalize_qk=True)
    variables = module.init(jax.random.key(0), jnp.ones((1, 2, 8)))
    with pytest.raises(ValueError, match="normalize_qk"):
        from_flax_linen(variables)
    params = to_flax_nnx_state(init_weights(8, bias=True), 2)
    del params["key"]["bias"]
    with pytest.raises(ValueError, match="biases on some projections only"):
        from_flax_nnx_state(params)
    # Flax's bias shapes alone: a flat or transposed one reshaped to other heads' biases.
    params = to_flax_nnx_state(init_weights(8, bias=True), 2)
    for bias in (params["query"]["bias"].reshape(-1), params["query"]["bias"].T):
        with pytest.raises(ValueError, match=r"^query/bias must have shape \(2, 4\); got "):
            from_flax_nnx_state({**params, "query": {**params["query"], "bias": bias}})
    with pytest.raises(ValueError, match=r"unexpected entries.*\['extra'\]"):
        from_flax_nnx_state({**to_flax_nnx_state(init_weights(8), 2), "extra": {}})
    with pytest.raises(ValueError, match=r"missing \['out'\]"):
        from_flax_nnx_state(
            {k: v for k, v in to_flax_nnx_state(init_weights(8), 2).items() if k != "out"}
        )
    with pytest.raises(
        ValueError, match=r"W_q has 8 columns, which num_heads \(3\) does not divide"
    ):
        to_flax_nnx_state(init_weights(8), 3)


@pytest.mark.parametrize(
    ("num_kv_heads", "qkv_features", "out_features"), [(2, 8, 8), (1, 12, 8), (4, 12, 10)]
)
def test_nnx_grouped_heads_and_own_widths_both_ways(num_kv_heads, qkv_features, out_features):
    # NNX's num_kv_heads and a qkv_features other than out_features are
    # grouped heads and an explicit head_dim: its own output is the reference's.
    native = nnx.MultiHeadAttention(
        4,
        6,
        qkv_features=qkv_features,
        out_features=out_features,
        num_kv_heads=num_kv_heads,
        decode=False,
        rngs=nnx.Rngs(3),
    )
    weights = from_flax_nnx(native)
    assert weights["W_k"].shape == (6, num_kv_heads * qkv_features // 4)
    rng = np.random.default_rng(5)
    q, kv = rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 5, 6))
    lens = np.array([2, 5])
    mask = attention_mask(lens, 3, 5, causal=False)
    expected, _ = spec.reference_forward(weights, q, kv, kv, lens, num_heads=4)
    got = native(q.astype(np.float32), kv.astype(np.float32), mask=mask, deterministic=True)
    np.testing.assert_allclose(got, expected, rtol=0, atol=5e-6)
    back = to_flax_nnx(weights, 4)
    assert back.num_kv_heads == num_kv_heads
    np.testing.assert_allclose(
        back(q.astype(np.float32), kv.astype(np.float32), mask=mask, deterministic=True),
        got,
        rtol=0,
        atol=1e-6,
    )
    ours = get_runner("jax-nnx").make_layer(
        out_features,
        4,
        query_size=6,
        key_size=6,
        value_size=6,
        num_kv_heads=num_kv_heads,
        head_dim=qkv_features // 4,
        bias=True,  # NNX's default use_bias
    )
    ours = set_weights(ours, weights)
    ours.eval()
    np.testing.assert_allclose(ours(q, kv, kv, lens), expected, rtol=0, atol=5e-6)


def test_float64_weights_without_x64_are_refused_not_rounded():
    """Without x64 JAX holds float64 arrays as float32: the variables would not be the
    weights (with it, they are, bit for bit)."""
    weights = init_weights(8, num_heads=2, bias=True, seed=0, dtype=np.float64)
    makers = {
        "to_flax_linen": lambda: to_flax_linen(weights, 2)[1]["params"]["query"]["kernel"],
        "to_jax_d2l": lambda: to_jax_d2l(weights)["params"]["W_q"]["kernel"],
        "variables_from_weights": lambda: linen.variables_from_weights(weights)["params"]["W_q"][
            "kernel"
        ],
        # (Parameters of a float64 param_dtype, which JAX held as float32.)
        "to_flax_nnx": lambda: to_flax_nnx(weights, 2, param_dtype=jnp.float64).query.kernel.value,
    }
    x64 = jax.config.jax_enable_x64
    try:
        jax.config.update("jax_enable_x64", False)
        for make in makers.values():
            with pytest.raises(ValueError, match="JAX holds float64 (weights|arrays) as float"):
                make()
    finally:
        jax.config.update("jax_enable_x64", x64)
    jax.config.update("jax_enable_x64", True)
    try:
        for name, make in makers.items():
            assert make().dtype == jnp.float64, name
    finally:
        jax.config.update("jax_enable_x64", x64)


def test_attention_mask_checks_the_lengths():
    for lens in (np.ones((1, 3), np.int32), np.ones((2, 2, 2), np.int32)):
        with pytest.raises(ValueError, match=r"valid_lens must have shape \(batch,\)"):
            attention_mask(lens, 5, 5)
    with pytest.raises(TypeError, match="valid_lens must be an integer or floating-point"):
        attention_mask(np.ones(2, bool), 5, 5)


def test_attention_mask_follows_the_spec_rule():
    # Hand-written: example 0 sees keys 0-1, example 1 key 0 only (from 0.5).
    mask = attention_mask(np.array([2.0, 0.5]), 2, 3)
    assert mask.shape == (2, 1, 1, 3)
    np.testing.assert_array_equal(mask[:, 0, 0], [[True, True, False], [True, False, False]])
    causal = attention_mask(None, 2, 3, causal=True)  # bottom-right: j <= i + 1
    np.testing.assert_array_equal(causal[0, 0], [[True, True, False], [True, True, True]])
    assert attention_mask(None, 2, 3) is None


# -- d2l's JAX layer ("Dive into Deep Learning", the book's code, Flax Linen) ------------


def _sequence_mask(X, valid_len, value=0):
    maxlen = X.shape[1]
    mask = jnp.arange((maxlen), dtype=jnp.float32)[None, :] < valid_len[:, None]
    return jnp.where(mask, X, value)


def masked_softmax(X, valid_lens):
    if valid_lens is None:
        return nn.softmax(X, axis=-1)
    shape = X.shape
    if valid_lens.ndim == 1:
        valid_lens = jnp.repeat(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = _sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
    return nn.softmax(X.reshape(shape), axis=-1)


class DotProductAttention(nn.Module):
    dropout: float

    @nn.compact
    def __call__(self, queries, keys, values, valid_lens=None, training=False):
        d = queries.shape[-1]
        scores = queries @ (keys.swapaxes(1, 2)) / math.sqrt(d)
        attention_weights = masked_softmax(scores, valid_lens)
        dropout_layer = nn.Dropout(self.dropout, deterministic=not training)
        return dropout_layer(attention_weights) @ values, attention_weights


class D2LMultiHeadAttention(nn.Module):
    num_hiddens: int
    num_heads: int
    dropout: float
    bias: bool = False

    def setup(self):
        self.attention = DotProductAttention(self.dropout)
        self.W_q = nn.Dense(self.num_hiddens, use_bias=self.bias)
        self.W_k = nn.Dense(self.num_hiddens, use_bias=self.bias)
        self.W_v = nn.Dense(self.num_hiddens, use_bias=self.bias)
        self.W_o = nn.Dense(self.num_hiddens, use_bias=self.bias)

    def __call__(self, queries, keys, values, valid_lens, training=False):
        queries = self.transpose_qkv(self.W_q(queries))
        keys = self.transpose_qkv(self.W_k(keys))
        values = self.transpose_qkv(self.W_v(values))
        if valid_lens is not None:
            valid_lens = jnp.repeat(valid_lens, self.num_heads, axis=0)
        output, attention_weights = self.attention(
            queries, keys, values, valid_lens, training=training
        )
        output_concat = self.transpose_output(output)
        return self.W_o(output_concat), attention_weights

    def transpose_qkv(self, X):
        X = X.reshape((X.shape[0], X.shape[1], self.num_heads, -1))
        X = jnp.transpose(X, (0, 2, 1, 3))
        return X.reshape((-1, X.shape[2], X.shape[3]))

    def transpose_output(self, X):
        X = X.reshape((-1, self.num_heads, X.shape[1], X.shape[2]))
        X = jnp.transpose(X, (0, 2, 1, 3))
        return X.reshape((X.shape[0], X.shape[1], -1))


@pytest.mark.parametrize("name", ["book", "bias", "lens_2d", "lens_zero", "cross_sizes"])
def test_d2l_layer_with_converted_weights_matches_the_reference(cases, name):
    c = cases[name]
    d2l = D2LMultiHeadAttention(c.config.num_hiddens, c.config.num_heads, 0.0, c.config.bias)
    variables = to_jax_d2l(c.weights)
    out, weights = d2l.apply(variables, *inputs(c), jnp.asarray(c.valid_lens))
    np.testing.assert_allclose(out, c.reference["output"], atol=5e-6)
    np.testing.assert_allclose(
        weights.reshape(c.reference["attention_weights"].shape),
        c.reference["attention_weights"],
        atol=5e-6,
    )


def test_d2l_variables_round_trip_and_strict_loading():
    d2l = D2LMultiHeadAttention(12, 3, 0.1, bias=True)
    x = jnp.ones((2, 4, 7))
    variables = d2l.init(jax.random.key(0), x, jnp.ones((2, 5, 6)), jnp.ones((2, 5, 6)), None)
    weights = from_jax_d2l(variables)
    assert weights["W_q"].shape == (7, 12) and weights["b_o"].shape == (12,)
    jax.tree.map(np.testing.assert_array_equal, to_jax_d2l(weights), variables)
    # Our Linen module uses d2l's layout: the variables load as they are.
    module = linen.MultiHeadAttention(12, 3, bias=True)
    assert linen.weights_from_variables(variables).keys() == weights.keys()
    ours = module.apply(variables, x, jnp.ones((2, 5, 6)), jnp.ones((2, 5, 6)))
    theirs, _ = d2l.apply(variables, x, jnp.ones((2, 5, 6)), jnp.ones((2, 5, 6)), None)
    np.testing.assert_allclose(ours, theirs, atol=5e-6)
    with pytest.raises(ValueError, match="unexpected entry 'attention'"):
        from_jax_d2l({"params": {**variables["params"], "attention": {"x": x}}})
    with pytest.raises(ValueError, match="unexpected entry 'W_q/scale'"):
        params = dict(variables["params"])
        params["W_q"] = {**params["W_q"], "scale": x}
        from_jax_d2l(params)
    with pytest.raises(ValueError, match="missing 'b_k'"):
        params = dict(variables["params"])
        params["W_k"] = {"kernel": params["W_k"]["kernel"]}
        from_jax_d2l(params)


def test_nnx_state_of_ours_and_canonical_weights_agree():
    weights = init_weights(8, bias=True, seed=5)
    layer = set_weights(MultiHeadAttention(8, 2, bias=True, rngs=nnx.Rngs(0)), weights)
    native = to_flax_nnx(get_weights(layer), 2)
    back = from_flax_nnx(native)
    assert all(back[n].tobytes() == weights[n].tobytes() for n in weights)
