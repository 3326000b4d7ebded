"""Weights to and from d2l's MXNet layer, and ``python -m mha_multi convert`` with ``.params``."""

from __future__ import annotations

import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from mha_multi.__main__ import convert, main
from mha_multi.bench.mxnet import D2LMultiHeadAttention
from mha_multi.interop.mxnet import (
    from_mxnet_d2l,
    from_mxnet_d2l_state,
    load_mxnet_d2l,
    save_mxnet_d2l,
    to_mxnet_d2l,
    to_mxnet_d2l_state,
)
from mha_multi.mxnet import MultiHeadAttention, get_weights, set_weights
from mha_multi.parity.cases import INPUT_NAMES
from mha_multi.parity.runners import get_runner
from mha_multi.weights import init_weights, load_weights, save_weights

#: Cases d2l's layer expresses: no lengths or 1-D lengths, no causal mask.
D2L_CASES = ("book", "bias", "lens_none", "lens_1d", "lens_zero", "cross_sizes")
RUNNER = get_runner("mxnet")


def d2l_layer(case, *, hybridize):
    layer = D2LMultiHeadAttention(
        case.config.num_hiddens, case.config.num_heads, use_bias=case.config.bias
    )
    if hybridize:
        layer.hybridize()
    return layer


def d2l_output(layer, case):
    """d2l's layer on the case's inputs, with the lengths in float32 as d2l passes them."""
    args = [RUNNER.to_native(case.inputs[n]) for n in INPUT_NAMES]
    if case.valid_lens is not None:
        args.append(RUNNER.to_native(case.valid_lens, dtype="float32"))
    return RUNNER.to_numpy(layer(*args))


@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("name", D2L_CASES)
def test_d2l_layer_loads_converted_params_and_matches_ours(tmp_path, cases, name, hybridize):
    case = cases[name]
    save_weights(tmp_path / "w.safetensors", case.weights)
    assert main(["convert", str(tmp_path / "w.safetensors"), str(tmp_path / "d2l.params")]) == 0
    layer = d2l_layer(case, hybridize=hybridize)
    layer.load_parameters(str(tmp_path / "d2l.params"))  # d2l's own loading, deferred sizes
    got = d2l_output(layer, case)
    np.testing.assert_allclose(got, case.reference["output"], rtol=0, atol=5e-6)
    ours = MultiHeadAttention(case.config.num_hiddens, case.config.num_heads, bias=case.config.bias)
    ours.load_parameters(str(tmp_path / "d2l.params"))  # the same file, same names
    lens = None if case.valid_lens is None else case.valid_lens.astype(np.float32)
    ours_output = RUNNER.call(ours, *(case.inputs[n] for n in INPUT_NAMES), lens)
    np.testing.assert_allclose(got, ours_output, rtol=0, atol=5e-6)
    np.testing.assert_allclose(ours_output, case.reference["output"], rtol=0, atol=5e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_trained_d2l_layer_converts_into_ours(tmp_path, bias):
    # A d2l layer with its own (Xavier) parameters: save_parameters, convert,
    # and our layer computes what d2l's does.
    rng = np.random.default_rng(7)
    q = RUNNER.to_native(rng.standard_normal((2, 4, 6)))
    kv = RUNNER.to_native(rng.standard_normal((2, 5, 3)))
    lens = RUNNER.to_native(np.array([3, 0]))
    d2l = D2LMultiHeadAttention(8, 2, use_bias=bias)
    d2l.initialize(mx.init.Xavier())
    if bias:
        for dense in (d2l.W_q, d2l.W_k, d2l.W_v, d2l.W_o):
            dense.bias.initialize(mx.init.Normal(), force_reinit=True)
    expected = d2l(q, kv, kv, lens).asnumpy()
    d2l.save_parameters(str(tmp_path / "d2l.params"))
    weights = convert(tmp_path / "d2l.params", tmp_path / "w.npz", num_heads=2)
    assert sorted(weights) == sorted(
        ["W_q", "W_k", "W_v", "W_o"] + (["b_q", "b_k", "b_v", "b_o"] if bias else [])
    )
    assert weights["W_q"].shape == (6, 8) and weights["W_k"].shape == (3, 8)
    ours = set_weights(MultiHeadAttention(8, 2, bias=bias), load_weights(tmp_path / "w.npz"))
    np.testing.assert_allclose(ours(q, kv, kv, lens).asnumpy(), expected, rtol=0, atol=5e-6)
    from_block = from_mxnet_d2l(d2l)
    assert all(from_block[k].tobytes() == weights[k].tobytes() for k in weights)


def test_what_is_no_state_is_named():
    with pytest.raises(TypeError, match="params must be a mapping of names to arrays; got list"):
        from_mxnet_d2l_state([1, 2])


@pytest.mark.parametrize(
    ("options", "entry"), [({"sinks": True}, "sinks"), ({"qk_norm": {"scope": "heads"}}, "q_norm")]
)
def test_ours_with_weights_beyond_the_projections_is_no_d2l_block(options, entry):
    """Read as d2l's block, ours would lose them: the function computed would change."""
    ours = MultiHeadAttention(8, 2, **options)
    ours.initialize()
    x = mx.np.ones((1, 2, 8))
    ours(x, x, x)
    with pytest.raises(ValueError, match=f"unexpected entry '{entry}' in a d2l Multi"):
        from_mxnet_d2l(ours)


@pytest.mark.parametrize(
    ("dense", "message"),
    [
        ({"activation": "relu"}, "W_k has the activation"),
        ({"flatten": True}, r"W_k flattens its input \(flatten=True\)"),
    ],
)
def test_a_d2l_block_with_other_projections_is_refused_both_ways(dense, message):
    """d2l's projections are linear and take each position on its own: other Dense
    blocks would convert to another computation (they were read and loaded as they are)."""
    d2l = D2LMultiHeadAttention(8, 2)
    d2l.W_k = mx.gluon.nn.Dense(8, use_bias=False, in_units=8, **dense)
    d2l.initialize()
    with pytest.raises(ValueError, match=message):
        from_mxnet_d2l(d2l)
    with pytest.raises(ValueError, match=message):
        to_mxnet_d2l(init_weights(8, seed=0), d2l)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bias", [False, True])
def test_params_round_trip_is_bit_exact(tmp_path, bias, dtype):
    weights = {
        k: v.astype(dtype)
        for k, v in init_weights(12, key_size=5, value_size=3, bias=bias, seed=2).items()
    }
    params = to_mxnet_d2l_state(weights)
    assert params["W_k.weight"].shape == (12, 5)  # Gluon's (out, in)
    save_mxnet_d2l(tmp_path / "w.params", weights)
    for back in (from_mxnet_d2l_state(params), load_mxnet_d2l(tmp_path / "w.params")):
        assert sorted(back) == sorted(weights)
        assert all(back[k].dtype == np.dtype(dtype) for k in back)
        assert all(back[k].tobytes() == weights[k].tobytes() for k in weights)


@pytest.mark.parametrize("hybridize", [False, True])
def test_to_mxnet_d2l_loads_a_fresh_d2l_layer(cases, hybridize):
    case = cases["cross_sizes"]
    layer = to_mxnet_d2l(case.weights, d2l_layer(case, hybridize=hybridize))
    np.testing.assert_allclose(d2l_output(layer, case), case.reference["output"], atol=5e-6)
    back = from_mxnet_d2l(layer)
    assert all(back[k].tobytes() == case.weights[k].tobytes() for k in case.weights)


def test_ours_and_d2l_blocks_share_the_params_layout(tmp_path, cases):
    case = cases["bias"]
    ours = set_weights(
        MultiHeadAttention(case.config.num_hiddens, case.config.num_heads, bias=True), case.weights
    )
    assert all(from_mxnet_d2l(ours)[k].tobytes() == v.tobytes() for k, v in case.weights.items())
    ours.save_parameters(str(tmp_path / "ours.params"))
    loaded = load_mxnet_d2l(tmp_path / "ours.params")
    assert all(loaded[k].tobytes() == v.tobytes() for k, v in get_weights(ours).items())


def test_strict_errors(tmp_path):
    params = to_mxnet_d2l_state(init_weights(8, bias=True, seed=1))
    with pytest.raises(ValueError, match="unexpected entry 'attention.weight'"):
        from_mxnet_d2l_state({**params, "attention.weight": params["W_q.weight"]})
    missing = {k: v for k, v in params.items() if k != "W_k.weight"}
    with pytest.raises(ValueError, match="missing 'W_k'"):
        from_mxnet_d2l_state(missing)
    with pytest.raises(ValueError, match="W_o.weight must be 2-D"):
        from_mxnet_d2l_state({**params, "W_o.weight": params["W_o.bias"]})
    with pytest.raises(ValueError, match="b_v"):
        from_mxnet_d2l_state({**params, "W_v.bias": params["W_o.bias"][:3]})
    no_bias = D2LMultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="W_q has no bias but the weights have"):
        to_mxnet_d2l(init_weights(8, bias=True), no_bias)
    fixed = D2LMultiHeadAttention(8, 2)
    fixed.initialize()
    fixed(*(mx.np.zeros((1, 2, 8)),) * 3)  # sizes now 8
    with pytest.raises(ValueError, match="W_q of shape \\(6, 8\\) does not fit"):
        to_mxnet_d2l(init_weights(8, query_size=6), fixed)
    with pytest.raises(ValueError, match="has no Dense block 'W_q'"):
        from_mxnet_d2l(mx.gluon.nn.Dense(3))


def test_convert_clear_errors(tmp_path, capsys):
    (tmp_path / "junk.params").write_bytes(b"not a parameter file")
    assert main(["convert", str(tmp_path / "junk.params"), str(tmp_path / "w.npz")]) == 2
    assert "not a Gluon parameter file" in capsys.readouterr().err
    mx.npx.save(str(tmp_path / "list.params"), [mx.np.zeros(2)])
    assert main(["convert", str(tmp_path / "list.params"), str(tmp_path / "w.npz")]) == 2
    assert "unnamed arrays" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "none.params"), str(tmp_path / "w.npz")]) == 2
    # (The line every format gives for a missing file: the edge-cases guide's.)
    missing = f"error: [Errno 2] No such file or directory: {str(tmp_path / 'none.params')!r}"
    assert missing in capsys.readouterr().err
    save_weights(tmp_path / "w.npz", init_weights(8))
    assert (
        main(["convert", str(tmp_path / "w.npz"), str(tmp_path / "o.params"), "--num-heads", "3"])
        == 2
    )
    assert "not divisible by --num-heads (3)" in capsys.readouterr().err


def test_legacy_ndarray_params_files_load(tmp_path):
    # Files written outside the numpy interface (mx.nd.save, older d2l) load too.
    weights = init_weights(8, seed=4)
    legacy = {k: v.as_nd_ndarray() for k, v in to_mxnet_d2l_state(weights).items()}
    with mx.util.np_array(False), mx.util.np_shape(False):
        mx.nd.save(str(tmp_path / "legacy.params"), legacy)
    loaded = load_mxnet_d2l(tmp_path / "legacy.params")
    assert all(loaded[k].tobytes() == weights[k].tobytes() for k in weights)


def test_canonical_conversion_does_not_import_mxnet(tmp_path):
    save_weights(tmp_path / "w.npz", init_weights(8))
    code = (
        "import sys; from mha_multi.__main__ import main; "
        f"assert main(['convert', {str(tmp_path / 'w.npz')!r}, "
        f"{str(tmp_path / 'w.safetensors')!r}]) == 0; "
        "assert 'mxnet' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_grouped_params_load_into_ours_with_the_widths_of_the_weights(tmp_path, cases):
    case = cases["gqa"]  # 8 query heads read 2 key/value heads: W_k is (32, 8)
    config = case.config
    inputs = [case.inputs[n] for n in INPUT_NAMES]
    save_mxnet_d2l(tmp_path / "gqa.params", case.weights)
    loaded = MultiHeadAttention(config.num_hiddens, config.num_heads, bias=True, **config.heads())
    loaded.load_parameters(str(tmp_path / "gqa.params"))
    converted = to_mxnet_d2l(
        case.weights,
        MultiHeadAttention(config.num_hiddens, config.num_heads, bias=True, **config.heads()),
    )
    for ours in (loaded, converted):
        output = RUNNER.call(ours, *inputs, case.valid_lens, causal=True)
        np.testing.assert_allclose(output, case.reference["output"], rtol=0, atol=5e-6)
        back = from_mxnet_d2l(ours)
        assert all(back[k].tobytes() == v.tobytes() for k, v in case.weights.items())
    # d2l's layer projects keys to every query head's width.
    d2l = D2LMultiHeadAttention(config.num_hiddens, config.num_heads, use_bias=True)
    with pytest.raises(ValueError, match=r"W_k of shape \(32, 8\) does not fit"):
        to_mxnet_d2l(case.weights, d2l)
