"""The fused path (``keras.ops.dot_product_attention``) on the active Keras backend.

``tests/backends/test_fused_path.py`` checks that a default call on every
parity case follows the kernel plan wherever a runner has a fused kernel.
These tests check what is Keras' own: on which backends production takes
the kernel at all (written here, independently of the layer's table),
fully hidden rows, 16-bit inputs, the calls that take the generic path
(weights, dropout, float64, values the kernel would get wrong, traced
graphs), and what the kernel is given for grouped key/value heads on each
backend (as they are, or repeated once), each against the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from keras_testing import (  # noqa: E402, F401
    eager_flow,
    fused_kernel_here,
    inputs,
    keras_runner,
    kernel_key_heads,
)

from conftest import record_sdpa_key_heads  # noqa: E402
from mha_multi import spec  # noqa: E402
from mha_multi.keras._facts import FACTS, values_exact  # noqa: E402
from mha_multi.keras._kernel import DOT_PRODUCT_ATTENTION  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402
from mha_multi.weights import init_weights  # noqa: E402

#: Where the default call takes the kernel, per Keras backend and compute
#: dtype: the benchmark's choice (docs: "Fast paths"), written here
#: independently of the layer's own table.
FUSED_BY_DEFAULT = {
    "torch": {"float32", "float16", "bfloat16"},
    "tensorflow": set(),
    "jax": set(),
}
FUSED = "float32" in FUSED_BY_DEFAULT[backend.BACKEND]


def eager(layer, queries, keys, values, valid_lens=None, *, dtype="float32", **kwargs):
    """The layer called on tensors as a user calls it; outputs as float64 numpy.

    Not the runner's call, which compiles on JAX: a compiled call takes the
    generic path whatever the backend, and would hide the eager choice.
    """
    tensors = [backend.to_native(x, dtype=dtype) for x in (queries, keys, values)]
    result = layer(*tensors, backend.lens_to_native(valid_lens), **kwargs)
    if isinstance(result, tuple):
        return tuple(backend.to_numpy(r) for r in result)
    return backend.to_numpy(result)


def attend(runner, case, layer=None, **kwargs):
    """The case's call (its lengths and causal flag), eagerly."""
    layer = runner.layer_for(case) if layer is None else layer
    return eager(layer, *inputs(case), case.valid_lens, causal=case.config.causal, **kwargs)


def test_runner_plans_for_the_kernel_where_production_takes_it(runner):
    assert (runner.fused_kernel is not None) == FUSED


@pytest.mark.parametrize("name", ["lens_2d", "causal", "causal_more_queries"])
def test_default_call_takes_the_kernel_where_production_does(runner, cases, name):
    # TensorFlow and JAX included, which the generic test skips.
    case = cases[name]
    with runner.kernel_spy() as calls:
        output = attend(runner, case)
    assert len(calls) == int(FUSED)
    np.testing.assert_allclose(output, case.reference["output"], rtol=0, atol=5e-6)


def test_fully_hidden_rows_are_the_mean_of_all_values(runner):
    # Hand-computed: with lengths 0 every weight is 1/K, so each output row is
    # (mean of the projected values) @ W_o.
    weights = init_weights(8, seed=11)
    layer = runner.set_weights(runner.make_layer(8, 2), weights)
    rng = np.random.default_rng(0)
    q, kv = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
    with runner.kernel_spy() as calls:
        out = eager(layer, q, kv, kv, np.array([0, 0]))
    assert len(calls) == int(FUSED)
    expected = (kv @ weights["W_v"]).mean(axis=1, keepdims=True) @ weights["W_o"]
    np.testing.assert_allclose(out, np.broadcast_to(expected, (2, 3, 8)), rtol=0, atol=5e-6)


def test_fully_hidden_row_gradients_match_the_reference(runner, cases):
    case = cases["causal_more_queries"]  # rows 0 and 1 see no key
    with runner.kernel_spy() as calls:
        grads = runner.gradients(
            runner.layer_for(case),
            *inputs(case),
            case.valid_lens,
            causal=True,
            output_gradient=case.output_gradient,
            device="cpu",
            dtype="float32",
        )
    assert bool(calls) == FUSED  # the gradients went through the fused path
    checked = [name for name in case.reference if name.startswith("grad.")]
    assert checked
    for name in checked:
        np.testing.assert_allclose(
            grads[name.removeprefix("grad.")], case.reference[name], atol=5e-5, err_msg=name
        )


def test_dropout_in_training_takes_the_generic_path(runner, cases):
    case = cases["lens_zero"]
    config = case.config
    layer = runner.make_layer(
        config.num_hiddens, config.num_heads, bias=config.bias, dropout=0.5, seed=1
    )
    layer = runner.set_weights(layer, case.weights)
    with runner.kernel_spy() as calls:
        attend(runner, case, layer, training=True)
    assert calls == []  # the kernel has no dropout
    with runner.kernel_spy() as calls:
        out = attend(runner, case, layer)
    assert len(calls) == int(FUSED)
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)


def test_float64_takes_the_generic_path(runner, cases):
    case = cases["lens_1d"]
    with runner.kernel_spy() as calls:
        out = attend(runner, case, runner.layer_for(case, dtype="float64"), dtype="float64")
    assert calls == []
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_inputs_run_the_kernel_in_float32(runner, cases, dtype):
    case = cases["lens_zero"]  # fully hidden rows: -1e6 overflows float16
    layer = runner.layer_for(case, dtype=dtype)
    tensors = [backend.to_native(x, dtype=dtype) for x in inputs(case)]
    with runner.kernel_spy() as calls:
        out = layer(*tensors, case.valid_lens)
    assert len(calls) == int(dtype in FUSED_BY_DEFAULT[backend.BACKEND])
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=2e-2)


# -- compiled: values cannot be read, so the generic path (exact for all) --------


@pytest.mark.skipif(backend.BACKEND != "tensorflow", reason="tf.function is TensorFlow's")
@pytest.mark.parametrize("name", ["lens_zero", "causal", "causal_cross", "causal_more_queries"])
def test_tf_function_jit_compile_takes_the_generic_path(runner, cases, name):
    import tensorflow as tf

    case = cases[name]
    layer = runner.layer_for(case)
    lens = backend.lens_to_native(case.valid_lens)

    @tf.function(jit_compile=True)
    def compiled(q, k, v):
        return layer(q, k, v, lens, causal=case.config.causal)

    with runner.kernel_spy() as calls:
        out = compiled(*map(backend.to_native, inputs(case)))
    assert calls == []
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "tensorflow", reason="tf.function is TensorFlow's")
def test_tf_function_unknown_lengths_keep_the_causal_rule(runner, cases):
    # Q and K unknown while tracing: shapes are scalar tensors in the reshapes
    # and positions of the generic path.
    import tensorflow as tf

    case = cases["causal_more_queries"]
    layer = runner.layer_for(case)
    spec_3d = tf.TensorSpec((None, None, case.config.sizes()["query_size"]), tf.float32)
    compiled = tf.function(
        lambda q, k, v: layer(q, k, v, causal=True), input_signature=[spec_3d] * 3
    )
    with runner.kernel_spy() as calls:
        out = compiled(*map(backend.to_native, inputs(case)))
    assert calls == []
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "jax", reason="jax.jit is JAX's")
@pytest.mark.parametrize("name", ["lens_zero", "causal", "causal_more_queries"])
def test_jax_jit_of_stateless_call_takes_the_generic_path(runner, cases, name):
    import jax

    case = cases[name]
    layer = runner.layer_for(case)

    @jax.jit
    def compiled(values, q, k, v, lens):
        out, _ = layer.stateless_call(*values, q, k, v, lens, causal=case.config.causal)
        return out

    with runner.kernel_spy() as calls:
        out = compiled(backend.state(layer), *inputs(case), case.valid_lens)
    assert calls == []
    np.testing.assert_allclose(backend.to_numpy(out), case.reference["output"], atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "torch", reason="torch.compile is PyTorch's")
def test_torch_compile_tracing_takes_the_generic_path(runner, cases, monkeypatch):
    # What the layer sees while torch.compile traces it, without paying for a
    # compiler in the test run.
    import torch

    case = cases["causal_lens_2d"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with runner.kernel_spy() as calls:
        out = attend(runner, case)
    assert calls == []
    np.testing.assert_allclose(out, case.reference["output"], atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "torch", reason="torch.no_grad is PyTorch's")
def test_torch_backend_fused_path_no_grad(runner, cases):
    import torch

    case = cases["causal_lens_2d"]
    with torch.no_grad(), runner.kernel_spy() as calls:
        out = attend(runner, case)
    assert len(calls) == 1
    np.testing.assert_allclose(out, case.reference["output"], atol=5e-6)


# -- values the kernel would get wrong ---------------------------------------------


@pytest.mark.parametrize("edit", ["nan_query", "inf_key", "nan_value"])
def test_non_finite_projections_take_the_generic_path(runner, edit):
    weights = init_weights(8, seed=12)
    layer = runner.set_weights(runner.make_layer(8, 2), weights)
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (3, 5, 5))
    target, value = {"nan_query": (q, np.nan), "inf_key": (k, np.inf), "nan_value": (v, np.nan)}[
        edit
    ]
    target[1, 2, 3] = value
    lens = np.array([5, 2])
    with runner.kernel_spy() as calls:
        out = eager(layer, q, k, v, lens)
    assert calls == []
    expected, _ = spec.reference_forward(weights, q, k, v, lens, num_heads=2)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(out[finite], expected[finite], atol=5e-6)


def test_scores_below_the_mask_value_take_the_generic_path(runner):
    # Visible scores of -2e6 lie below the spec's -1e6 for hidden keys, so in
    # the spec the hidden keys take the weight; a kernel that adds a large
    # negative number to them would give it to the visible keys instead.
    size = 8
    rng = np.random.default_rng(13)
    weights = {
        "W_q": np.eye(size),
        "W_k": np.eye(size),
        "W_v": rng.standard_normal((size, size)),
        "W_o": np.eye(size),
    }
    layer = runner.set_weights(runner.make_layer(size, 2), weights)
    queries = np.full((1, 2, size), 1000.0)
    keys = np.full((1, 4, size), -1000.0)
    values = rng.standard_normal((1, 4, size))
    lens = np.array([2])
    with runner.kernel_spy() as calls:
        out = eager(layer, queries, keys, values, lens)
    assert calls == []
    expected, _ = spec.reference_forward(weights, queries, keys, values, lens, num_heads=2)
    np.testing.assert_allclose(out, expected, atol=5e-6)


@pytest.mark.parametrize("recording", [True, False], ids=["recording", "no gradient"])
@pytest.mark.parametrize("length", [16, 256])
def test_on_a_gpu_only_a_call_with_many_scores_reads_its_values(
    runner, monkeypatch, length, recording
):
    """A read waits for a GPU (here the facts are told the tensors are on one):
    only a call whose heads hold ``DEVICE_READ_SCORES`` scores reads the values
    for the kernel; a shorter one takes the generic path without reading. On
    PyTorch a call under ``torch.no_grad()`` records no gradient, and its 2 x 2 x
    256 x 256 scores in all are fewer than ``DEVICE_READ_TOTAL_SCORES``: it reads
    nothing either. TensorFlow and JAX do not tell, and read as when recording."""
    import contextlib

    from mha_multi.keras import _facts as facts

    records = recording or backend.BACKEND != "torch"
    if records:
        no_gradient = contextlib.nullcontext()
    else:
        import torch

        no_gradient = torch.no_grad()

    reads = []
    within = facts.values_within
    monkeypatch.setattr(facts, "device_of", lambda x: "gpu")
    monkeypatch.setattr(facts, "values_within", lambda *args: reads.append(1) or within(*args))
    weights = init_weights(8, seed=25)
    layer = runner.set_weights(runner.make_layer(8, 2), weights)
    x = np.random.default_rng(25).standard_normal((2, length, 8)).astype(np.float32)
    lens = np.array([length, length // 2])
    with runner.kernel_spy() as calls, no_gradient:
        out = eager(layer, x, x, x, lens)
    assert 2 * 2 * length * length < spec.DEVICE_READ_TOTAL_SCORES
    read = FUSED and length * length >= spec.DEVICE_READ_SCORES and records
    assert len(reads) == len(calls) == int(read)
    expected, _ = spec.reference_forward(weights, x, x, x, lens, num_heads=2)
    np.testing.assert_allclose(out, expected, atol=5e-6)


@pytest.mark.parametrize(
    ("scale", "exact"),
    [(1.0, True), (1e30, False), (np.nan, False), (np.inf, False)],
)
def test_values_exact_reads_the_values(scale, exact):
    q, k, v = (keras.ops.full((2, 3, 8), value) for value in (scale, 1.0, 1.0))
    assert values_exact(q, k, v, 4) is exact


@pytest.mark.parametrize("held", ["q", "k", "v"])
@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_values_exact_finds_one_non_finite_element_anywhere(held, special):
    arrays = {name: np.full((2, 3, 8), -2.0, np.float32) for name in "qkv"}
    assert values_exact(*(keras.ops.convert_to_tensor(arrays[n]) for n in "qkv"), 4) is True
    arrays[held][1, 2, 5] = special
    assert values_exact(*(keras.ops.convert_to_tensor(arrays[n]) for n in "qkv"), 4) is False


def test_fused_and_generic_paths_agree_on_a_longer_sequence(runner):
    weights = init_weights(32, seed=4)
    layer = runner.set_weights(runner.make_layer(32, 4), weights)
    x = np.random.default_rng(3).standard_normal((3, 40, 32)).astype(np.float32)
    lens = np.array([40, 17, 0])
    with runner.kernel_spy() as calls:
        fused = eager(layer, x, x, x, lens, causal=True)
    generic, _ = eager(layer, x, x, x, lens, causal=True, return_attention_weights=True)
    expected, _ = spec.reference_forward(weights, x, x, x, lens, num_heads=4, causal=True)
    assert len(calls) == int(FUSED)
    np.testing.assert_allclose(fused, expected, atol=5e-6)
    np.testing.assert_allclose(fused, generic, atol=5e-6)


# -- grouped key/value heads -------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_keras_kernel_takes_grouped_heads_where_the_layer_says(num_kv_heads):
    # What Keras 3.15 does with (B, K, H_kv, dh) keys, checked against numpy:
    # query head h reads key/value head h // G on PyTorch and JAX; TensorFlow's
    # einsum fails on a single key/value head, so the layer repeats them there.
    rng = np.random.default_rng(14)
    q = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    k, v = (rng.standard_normal((2, 6, num_kv_heads, 5)).astype(np.float32) for _ in range(2))
    repeated_k, repeated_v = (np.repeat(x, 4 // num_kv_heads, axis=2) for x in (k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, repeated_k) * 0.5
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bhqk,bkhd->bqhd", weights, repeated_v)
    try:
        out = backend.to_numpy(keras.ops.dot_product_attention(q, k, v, scale=0.5))
    except Exception:  # the backend's own error type
        assert not DOT_PRODUCT_ATTENTION.takes_grouped_heads
        assert backend.BACKEND == "tensorflow" and num_kv_heads == 1
        return
    np.testing.assert_allclose(out, expected, rtol=0, atol=5e-6)
    assert DOT_PRODUCT_ATTENTION.takes_grouped_heads == (backend.BACKEND != "tensorflow")


@pytest.mark.usefixtures("eager_flow")
@pytest.mark.parametrize("name", ["gqa", "mqa", "head_dim"])
def test_grouped_heads_reach_the_kernel_as_the_plan_says(
    runner, cases, name, fused_here, monkeypatch
):
    case = cases[name]
    key_heads = kernel_key_heads(monkeypatch)
    out = attend(runner, case)
    takes = DOT_PRODUCT_ATTENTION.takes_grouped_heads
    assert key_heads == [case.config.num_kv_heads if takes else case.config.num_heads]
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)


@pytest.mark.usefixtures("eager_flow")
@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_a_kernel_without_groups_gets_the_heads_repeated_once(
    runner, cases, name, fused_here, monkeypatch
):
    # The plan's repeat_kv: the projected (B, K, H_kv, dh) heads are repeated
    # h // G, never the inputs; fully hidden rows (gqa: length 0) take the
    # mean of their key/value head's values.
    kernel = spec.FusedKernel("keras.ops.dot_product_attention", takes_grouped_heads=False)
    monkeypatch.setattr(FACTS, "kernel", kernel)
    case = cases[name]
    key_heads = kernel_key_heads(monkeypatch)
    out = attend(runner, case)
    assert key_heads == [case.config.num_heads]
    np.testing.assert_allclose(out, case.reference["output"], rtol=0, atol=5e-6)
    grads = runner.gradients(
        runner.layer_for(case),
        *inputs(case),
        case.valid_lens,
        causal=case.config.causal,
        output_gradient=case.output_gradient,
        device="cpu",
        dtype="float32",
    )
    checked = [quantity for quantity in case.reference if quantity.startswith("grad.")]
    assert checked
    for quantity in checked:
        grad = grads[quantity.removeprefix("grad.")]
        expected = case.reference[quantity]
        assert grad.shape == expected.shape, quantity
        np.testing.assert_allclose(grad, expected, rtol=0, atol=5e-5, err_msg=quantity)


def test_grouped_fully_hidden_rows_are_their_key_value_heads_mean(runner):
    # Hand-computed: with length 0 every weight is 1/K, so query head h
    # outputs the mean of key/value head h // G's values.
    weights = init_weights(8, num_heads=4, num_kv_heads=2, head_dim=3, seed=15)
    layer = runner.set_weights(runner.make_layer(8, 4, num_kv_heads=2, head_dim=3), weights)
    rng = np.random.default_rng(15)
    q, kv = rng.standard_normal((1, 2, 8)), rng.standard_normal((1, 5, 8))
    with runner.kernel_spy() as calls:
        out = eager(layer, q, kv, kv, np.array([0]))
    assert len(calls) == int(FUSED)
    means = (kv @ weights["W_v"]).mean(axis=1).reshape(2, 3)  # (H_kv, dh)
    context = np.repeat(means, 2, axis=0).reshape(-1)  # query heads 0, 1 | 2, 3
    np.testing.assert_allclose(out[0], np.tile(context @ weights["W_o"], (2, 1)), atol=5e-6)


@pytest.mark.skipif(backend.BACKEND != "torch", reason="PyTorch's SDPA kernels")
@pytest.mark.parametrize("num_queries", [6, 1], ids=["six queries", "one query"])
def test_float32_grouped_heads_on_cuda_reach_sdpa_repeated(
    runner, fused_here, monkeypatch, num_queries
):
    """On Keras' PyTorch backend the plan follows PyTorch's rule for grouped heads
    (``repeats_grouped_heads``, told here that the CPU is CUDA): repeated for more
    queries than ``head_dim``; one query's heads the queries of their key/value head
    (no ``enable_gqa``), where the plan reads one query's values (a GPU's long
    call: the host's takes the generic path); both give the float64 reference's
    numbers."""
    import mha_multi.torch._facts as torch_facts

    monkeypatch.setattr(type(FACTS), "reads_values", lambda *args, **kwargs: True)

    monkeypatch.setattr(
        torch_facts,
        "repeats_grouped_heads",
        lambda q, queries, head_dim, dtype=None: queries > head_dim,
    )
    seen = record_sdpa_key_heads(monkeypatch)
    heads = {"num_heads": 4, "num_kv_heads": 2}
    weights = init_weights(16, **heads, seed=32)
    layer = runner.set_weights(runner.make_layer(16, 4, num_kv_heads=2), weights)
    x = np.random.default_rng(32).standard_normal((2, num_queries, 16)).astype(np.float32)
    lens = np.array([num_queries, max(num_queries - 2, 1)])
    out = eager(layer, x, x, x, lens)
    expected, _ = spec.reference_forward(weights, x, x, x, lens, **heads)
    # Four dimensions a head: six queries get the heads repeated, one query folded.
    assert seen == ([(4, False)] if num_queries > 4 else [(2, False)])
    np.testing.assert_allclose(out, expected, rtol=0, atol=5e-6)


def test_lengths_known_on_the_host_that_hide_no_key_give_the_kernel_no_mask(runner):
    """Numpy lengths (``stateless_call`` passes them as they are), and a cached
    call's lengths that the call before returned, are known on the host without a
    read: where they hide no key the kernel takes no mask (and no row is fixed),
    where they hide some it takes one; a decoding step (one query) takes the
    generic path on the host; every output against the float64 reference."""
    weights = init_weights(16, num_heads=4, num_kv_heads=2, seed=41)
    layer = runner.set_weights(runner.make_layer(16, 4, num_kv_heads=2), weights)
    x = np.random.default_rng(41).standard_normal((2, 7, 16)).astype(np.float32)
    variables = ([v.value for v in layer.trainable_variables], [])
    for lens, masked in ((np.array([7, 9]), False), (np.array([7, 4]), True)):
        q = backend.to_native(x)
        with runner.kernel_spy() as calls:
            out = backend.to_numpy(layer.stateless_call(*variables, q, q, q, lens)[0])
        assert [call.mask for call in calls] == ([masked] if FUSED else [])
        expected, _ = spec.reference_forward(weights, x, x, x, lens, num_heads=4, num_kv_heads=2)
        np.testing.assert_allclose(out, expected, rtol=0, atol=5e-6)
    cache = layer.init_cache(2, 12)
    prompt = backend.to_native(x[:, :3])
    _, cache = layer(prompt, prompt, prompt, causal=True, cache=cache)
    # Two new positions, not causal: every example at one length, all of it attended
    # over, nothing hidden. Then a causal pair (the causal rule hides keys), and a step.
    for start, stop, causal, masked in (
        (3, 5, False, [False]),
        (5, 7, True, [True]),
        (7, 8, True, []),
    ):
        chunk = backend.to_native(x[:, start:stop])
        with runner.kernel_spy() as calls:
            out, cache = layer(chunk, chunk, chunk, causal=causal, cache=cache)
        assert [call.mask for call in calls] == (masked if FUSED else [])
        whole = x[:, :stop]
        reference, _ = spec.reference_forward(
            weights,
            whole[:, start:],
            whole,
            whole,
            num_heads=4,
            num_kv_heads=2,
            causal=causal,
        )
        np.testing.assert_allclose(backend.to_numpy(out), reference, rtol=0, atol=5e-6)


@pytest.mark.parametrize("num_keys", [7, 8, 15, 16])
def test_a_mask_over_few_keys_on_a_cpu_follows_pytorchs_rule(runner, num_keys):
    """On PyTorch's CPU a call of more than one query over 8 to 15 keys that needs a
    mask takes the generic path, as PyTorch's layer's does (SDPA's CPU kernel takes
    such a mask on a slow path: docs: "Fast paths"); 7 or 16 keys keep the kernel.
    Every output against the float64 reference."""
    weights = init_weights(16, num_heads=4, seed=43)
    layer = runner.set_weights(runner.make_layer(16, 4), weights)
    x = np.random.default_rng(43).standard_normal((2, num_keys, 16)).astype(np.float32)
    lens = np.array([num_keys, 3])
    with runner.kernel_spy() as calls:
        out = eager(layer, x, x, x, lens)
    few = (
        backend.BACKEND == "torch"
        and backend.to_native(x).device.type == "cpu"
        and 8 <= num_keys < 16
    )
    assert [call.mask for call in calls] == ([True] if FUSED and not few else [])
    expected, _ = spec.reference_forward(weights, x, x, x, lens, num_heads=4)
    np.testing.assert_allclose(out, expected, rtol=0, atol=5e-6)
