"""The fused path (``keras.ops.dot_product_attention``) on the active Keras backend.

The parity suite checks the default call on every case and dtype; these tests
check that the default call goes through the kernel exactly where production
takes it (Keras' PyTorch backend, eagerly), with the mask and ``is_causal``
expected, that fully hidden rows get the spec's values, and that the calls
which need the generic path (weights, dropout, dtypes the kernels are not
made for, values the kernel would get wrong, traced graphs, the TensorFlow
and JAX backends) take it.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from mha_multi import spec  # noqa: E402
from mha_multi.keras import MultiHeadAttention, set_weights  # noqa: E402
from mha_multi.keras import layer as layer_module  # noqa: E402
from mha_multi.keras._ops import to_numpy  # noqa: E402
from mha_multi.parity.cases import CASES, build_case  # noqa: E402
from mha_multi.weights import init_weights  # noqa: E402

BACKEND = keras.backend.backend()

#: Where the default call should use the kernel, per Keras backend and compute
#: dtype: the benchmark's choice (docs/guides/fast-paths.md), written here
#: independently of the layer's own table.
FUSED_BY_DEFAULT = {
    "torch": {"float32", "float16", "bfloat16"},
    "tensorflow": set(),
    "jax": set(),
}
FUSED = "float32" in FUSED_BY_DEFAULT[BACKEND]

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


def case_named(name):
    return build_case(next(c for c in CASES if c.name == name))


def layer_for(case, **kwargs):
    # The weights are loaded at once: no random initialisation, which on the
    # JAX backend compiles anew for every shape.
    kwargs.setdefault("kernel_initializer", "zeros")
    layer = MultiHeadAttention(
        case.config.num_hiddens, case.config.num_heads, bias=case.config.bias, **kwargs
    )
    return set_weights(layer, case.weights)


def arrays(case, dtype="float32"):
    return [
        keras.ops.cast(keras.ops.convert_to_tensor(case.inputs[name]), dtype)
        for name in ("queries", "keys", "values")
    ]


def numpy(x):
    return to_numpy(x).astype(np.float64)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records the mask and ``is_causal`` of every ``dot_product_attention`` call."""
    calls = []
    original = keras.ops.dot_product_attention

    def recording(query, key, value, **kwargs):
        mask = kwargs.get("mask")
        calls.append(
            {
                "mask_shape": None if mask is None else tuple(mask.shape),
                "is_causal": kwargs.get("is_causal", False),
                "scale": kwargs.get("scale"),
            }
        )
        return original(query, key, value, **kwargs)

    monkeypatch.setattr(keras.ops, "dot_product_attention", recording)
    return calls


def expected_mask_shape(case):
    """``visibility``'s shape: (B, 1, 1|Q, K) with lengths, (1, 1, Q, K) causal only."""
    config, lens = case.config, case.valid_lens
    if lens is None:
        return (1, 1, config.num_queries, config.num_keys)
    rows = 1 if lens.ndim == 1 and not config.causal else config.num_queries
    return (config.batch, 1, rows, config.num_keys)


@pytest.mark.parametrize(
    ("name", "masked", "is_causal"),
    [
        ("lens_none", False, False),
        ("lens_1d", True, False),
        ("lens_2d", True, False),
        ("lens_zero", True, False),  # every row of example 0 fully hidden
        ("lens_overlong", True, False),
        ("causal", False, True),  # Q == K: the kernel's own (top-left) flag
        ("causal_cross", True, False),  # bottom-right alignment needs a mask
        ("causal_more_queries", True, False),  # leading rows fully hidden
        ("causal_lens_2d", True, False),
    ],
)
def test_default_call_takes_the_fused_path(kernel_calls, name, masked, is_causal):
    case = case_named(name)
    layer = layer_for(case)
    lens = case.valid_lens
    out = layer(*arrays(case), lens, causal=case.config.causal)
    assert len(kernel_calls) == int(FUSED)
    if FUSED:
        call = kernel_calls[0]
        assert call["mask_shape"] == (expected_mask_shape(case) if masked else None)
        assert call["is_causal"] == is_causal
        assert call["scale"] == pytest.approx(
            1 / np.sqrt(case.config.num_hiddens // case.config.num_heads)
        )
    np.testing.assert_allclose(numpy(out), case.reference["output"], atol=5e-6)
    out, weights = layer(
        *arrays(case), lens, causal=case.config.causal, return_attention_weights=True
    )
    assert len(kernel_calls) == int(FUSED)  # the weights come from the generic path
    np.testing.assert_allclose(numpy(weights), case.reference["attention_weights"], atol=5e-6)


def test_fully_hidden_rows_are_the_mean_of_all_values(kernel_calls):
    # Hand-computed: with lengths 0 every weight is 1/K, so each output row is
    # (mean of the projected values) @ W_o.
    weights = init_weights(8, seed=11)
    layer = set_weights(MultiHeadAttention(8, 2, kernel_initializer="zeros"), weights)
    rng = np.random.default_rng(0)
    q, kv = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
    out = layer(*(x.astype(np.float32) for x in (q, kv, kv)), np.array([0, 0]))
    assert len(kernel_calls) == int(FUSED)
    expected = (kv @ weights["W_v"]).mean(axis=1, keepdims=True) @ weights["W_o"]
    np.testing.assert_allclose(numpy(out), np.broadcast_to(expected, (2, 3, 8)), atol=5e-6)


def test_fully_hidden_row_gradients_match_the_reference(kernel_calls):
    case = case_named("causal_more_queries")  # rows 0 and 1 see no key
    from mha_multi.parity.runners import get_runner

    runner = get_runner(f"keras-{BACKEND}")
    layer = runner.layer_for(case, device="cpu", dtype="float32")
    grads = runner.gradients(
        layer,
        *(case.inputs[n] for n in ("queries", "keys", "values")),
        case.valid_lens,
        causal=True,
        output_gradient=case.output_gradient,
        device="cpu",
        dtype="float32",
    )
    assert bool(kernel_calls) == FUSED  # the gradients went through the fused path
    checked = [name for name in case.reference if name.startswith("grad.")]
    assert checked
    for name in checked:
        np.testing.assert_allclose(
            grads[name.removeprefix("grad.")], case.reference[name], atol=5e-5, err_msg=name
        )


def test_dropout_in_training_takes_the_generic_path(kernel_calls):
    case = case_named("lens_zero")
    layer = layer_for(case, dropout=0.5, seed=1)
    layer(*arrays(case), case.valid_lens, training=True)
    assert kernel_calls == []  # the kernel has no dropout
    out = layer(*arrays(case), case.valid_lens, training=False)
    assert len(kernel_calls) == int(FUSED)
    np.testing.assert_allclose(numpy(out), case.reference["output"], atol=5e-6)


def test_float64_takes_the_generic_path(kernel_calls):
    case = case_named("lens_1d")
    layer = layer_for(case, dtype="float64")
    out = layer(*arrays(case, "float64"), case.valid_lens)
    assert kernel_calls == []
    np.testing.assert_allclose(numpy(out), case.reference["output"], atol=1e-12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_fused_path_within_tolerance(kernel_calls, dtype):
    case = case_named("lens_zero")  # fully hidden rows: -1e6 overflows float16
    layer = layer_for(case, dtype=dtype)
    out = layer(*arrays(case, dtype), case.valid_lens)
    assert len(kernel_calls) == int(dtype in FUSED_BY_DEFAULT[BACKEND])
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    np.testing.assert_allclose(numpy(out), case.reference["output"], atol=2e-2)


# -- compiled: values cannot be read, so the generic path (exact for all) --------


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function is TensorFlow's")
@pytest.mark.parametrize("name", ["lens_zero", "causal", "causal_cross", "causal_more_queries"])
def test_tf_function_jit_compile_takes_the_generic_path(kernel_calls, name):
    import tensorflow as tf

    case = case_named(name)
    layer = layer_for(case)
    lens = None if case.valid_lens is None else tf.constant(case.valid_lens)

    @tf.function(jit_compile=True)
    def attend(q, k, v):
        return layer(q, k, v, lens, causal=case.config.causal)

    out = attend(*arrays(case))
    assert kernel_calls == []
    np.testing.assert_allclose(out.numpy(), case.reference["output"], atol=5e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function is TensorFlow's")
def test_tf_function_unknown_lengths_keep_the_causal_rule(kernel_calls):
    # Q and K unknown while tracing: shapes are scalar tensors in the reshapes
    # and positions of the generic path.
    import tensorflow as tf

    case = case_named("causal_more_queries")
    layer = layer_for(case)
    spec_3d = tf.TensorSpec((None, None, case.config.sizes()["query_size"]), tf.float32)
    attend = tf.function(lambda q, k, v: layer(q, k, v, causal=True), input_signature=[spec_3d] * 3)
    out = attend(*arrays(case))
    assert kernel_calls == []
    np.testing.assert_allclose(out.numpy(), case.reference["output"], atol=5e-6)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit is JAX's")
@pytest.mark.parametrize("name", ["lens_zero", "causal", "causal_more_queries"])
def test_jax_jit_of_stateless_call_takes_the_generic_path(kernel_calls, name):
    import jax

    case = case_named(name)
    layer = layer_for(case)

    @jax.jit
    def attend(trainable, non_trainable, q, k, v, lens):
        out, _ = layer.stateless_call(
            trainable, non_trainable, q, k, v, lens, causal=case.config.causal
        )
        return out

    out = attend(
        [v.value for v in layer.trainable_variables],
        [v.value for v in layer.non_trainable_variables],
        *arrays(case),
        case.valid_lens,
    )
    assert kernel_calls == []
    np.testing.assert_allclose(np.asarray(out), case.reference["output"], atol=5e-6)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile is PyTorch's")
def test_torch_compile_tracing_takes_the_generic_path(kernel_calls, monkeypatch):
    # What the layer sees while torch.compile traces it, without paying for a
    # compiler in the test run.
    import torch

    case = case_named("causal_lens_2d")
    layer = layer_for(case)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = layer(*arrays(case), case.valid_lens, causal=True)
    assert kernel_calls == []
    np.testing.assert_allclose(numpy(out), case.reference["output"], atol=5e-6)


# -- values the kernel would get wrong ---------------------------------------------


@pytest.mark.parametrize("edit", ["nan_query", "inf_key", "nan_value"])
def test_non_finite_projections_take_the_generic_path(kernel_calls, edit):
    weights = init_weights(8, seed=12)
    layer = set_weights(MultiHeadAttention(8, 2, kernel_initializer="zeros"), weights)
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (3, 5, 5))
    target, value = {"nan_query": (q, np.nan), "inf_key": (k, np.inf), "nan_value": (v, np.nan)}[
        edit
    ]
    target[1, 2, 3] = value
    lens = np.array([5, 2])
    out = numpy(layer(*(x.astype(np.float32) for x in (q, k, v)), lens))
    assert kernel_calls == []
    expected, _ = spec.reference_forward(weights, q, k, v, lens, num_heads=2)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(out[finite], expected[finite], atol=5e-6)


def test_scores_below_the_mask_value_take_the_generic_path(kernel_calls):
    # Visible scores of -2e6 lie below the spec's -1e6 for hidden keys, so in
    # the spec the hidden keys take the weight; a kernel that adds a large
    # negative number to them would give it to the visible keys instead.
    size = 8
    weights = {
        "W_q": np.eye(size),
        "W_k": np.eye(size),
        "W_v": np.random.default_rng(13).standard_normal((size, size)),
        "W_o": np.eye(size),
    }
    layer = set_weights(MultiHeadAttention(size, 2, kernel_initializer="zeros"), weights)
    queries = np.full((1, 2, size), 1000.0)
    keys = np.full((1, 4, size), -1000.0)
    values = np.random.default_rng(14).standard_normal((1, 4, size))
    lens = np.array([2])
    out = numpy(layer(*(x.astype(np.float32) for x in (queries, keys, values)), lens))
    assert kernel_calls == []
    expected, _ = spec.reference_forward(weights, queries, keys, values, lens, num_heads=2)
    np.testing.assert_allclose(out, expected, atol=5e-6)


@pytest.mark.parametrize(
    ("scale", "exact"),
    [(1.0, True), (1e30, False), (np.nan, False), (np.inf, False)],
)
def test_values_exact_reads_the_values(scale, exact):
    q, k, v = (keras.ops.full((2, 3, 8), value) for value in (scale, 1.0, 1.0))
    assert layer_module.values_exact(q, k, v, 4) is exact


@pytest.mark.skipif(BACKEND != "torch", reason="torch.no_grad is PyTorch's")
def test_torch_backend_fused_path_no_grad(kernel_calls):
    assert FUSED
    import torch

    case = case_named("causal_lens_2d")
    layer = layer_for(case)
    with torch.no_grad():
        out = layer(*arrays(case), case.valid_lens, causal=True)
    assert len(kernel_calls) == 1
    np.testing.assert_allclose(numpy(out), case.reference["output"], atol=5e-6)


def test_fused_and_generic_paths_agree_on_a_longer_sequence(kernel_calls):
    weights = init_weights(32, seed=4)
    layer = set_weights(MultiHeadAttention(32, 4, kernel_initializer="zeros"), weights)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 40, 32)).astype(np.float32)
    lens = np.array([40, 17, 0])
    fused = numpy(layer(x, x, x, lens, causal=True))
    generic = numpy(layer(x, x, x, lens, causal=True, return_attention_weights=True)[0])
    expected, _ = spec.reference_forward(weights, x, x, x, lens, num_heads=4, causal=True)
    assert len(kernel_calls) == int(FUSED)
    np.testing.assert_allclose(fused, expected, atol=5e-6)
    np.testing.assert_allclose(fused, generic, atol=5e-6)
