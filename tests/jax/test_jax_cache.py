"""JAX's cached calls: compiled decoding steps, overflow under jit, the fused kernel, pieces.

The behaviour every backend shares is in ``tests/backends/test_cache.py``
(eager calls); here is what only JAX has: ``jax.jit``/``nnx.jit`` steps
with static shapes, what compiled code does where an eager call raises,
``jax.nn.dot_product_attention`` on a cache, and the CPU's batch pieces.
Every number is checked against the float64 reference: one full causal
forward, :func:`mha_multi.spec.reference_cached_forward` or
:func:`mha_multi.spec.reference_gradients`.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax_support import LinenRunner, NNXRunner, nan_where_nothing_is_seen

from mha_multi import spec
from mha_multi.jax import MultiHeadAttention, _facts, linen
from mha_multi.jax._kernel import DOT_PRODUCT_ATTENTION
from mha_multi.parity.decode import decode, full_reference
from mha_multi.parity.harness import jax as backend
from mha_multi.weights import init_weights

CONFIGS = {
    "gqa": {"num_hiddens": 8, "num_heads": 4, "num_kv_heads": 2, "bias": True},
    "mqa": {"num_hiddens": 6, "num_heads": 2, "num_kv_heads": 1, "head_dim": 4, "bias": False},
}
SIZES = {"query_size": 5, "key_size": 3, "value_size": 4}
#: A prefill, then chunks of 1 and of 3 positions; lengths [7, 7, 4].
CHUNKS = [(4, [4, 2, 0]), (1, [1, 1, 1]), (3, [1, 3, 2]), (1, [0, 1, 1]), (1, [1, 0, 0])]
LENGTHS = np.array([7, 7, 4])
MAX_LENGTH = 8


def heads_of(config):
    return {k: v for k, v in config.items() if k in ("num_kv_heads", "head_dim")}


def weights_of(name, seed=0):
    config = CONFIGS[name]
    return init_weights(
        config["num_hiddens"],
        bias=config["bias"],
        num_heads=config["num_heads"],
        seed=seed,
        **heads_of(config),
        **SIZES,
    )


def inputs_of(seed, batch=3, length=8):
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal((batch, length, SIZES[size])).astype(np.float32)
        for name, size in (
            ("queries", "query_size"),
            ("keys", "key_size"),
            ("values", "value_size"),
        )
    }


def layer_of(runner, name, weights, dtype="float32"):
    config = CONFIGS[name]
    layer = runner.make_layer(
        config["num_hiddens"],
        config["num_heads"],
        bias=config["bias"],
        dtype=dtype,
        **heads_of(config),
        **SIZES,
    )
    return runner.set_weights(layer, weights)


def reference_heads(name):
    config = CONFIGS[name]
    return {"num_heads": config["num_heads"], "num_kv_heads": config["num_kv_heads"]}


def compiled(layer, **options):
    """``step(q, k, v, lens, cache)``, one ``jax.jit``/``nnx.jit`` cached call, and its traces."""
    traces = []
    if isinstance(layer, backend.LinenLayer):
        module = layer.module

        @jax.jit
        def linen_step(variables, q, k, v, lens, cache):
            traces.append(q.shape[1])
            return module.apply(variables, q, k, v, lens, causal=True, cache=cache, **options)

        return (lambda *args: linen_step(layer.variables, *args)), traces
    layer.eval()

    @nnx.jit
    def nnx_step(layer, q, k, v, lens, cache):
        traces.append(q.shape[1])
        return layer(q, k, v, lens, causal=True, cache=cache, **options)

    return (lambda *args: nnx_step(layer, *args)), traces


def compiled_decode(layer, inputs, dtype):
    """:func:`mha_multi.parity.decode.decode` of :data:`CHUNKS` through one compiled step."""
    step, traces = compiled(layer)
    cache = backend.init_cache(layer, len(LENGTHS), MAX_LENGTH)

    def call(queries, keys, values, new_lens):
        nonlocal cache
        arrays = (backend.to_native(x, "cpu", dtype) for x in (queries, keys, values))
        output, cache = step(*arrays, jnp.asarray(new_lens), cache)
        return backend.to_numpy(output)

    return decode(call, inputs, LENGTHS, CHUNKS), traces


@pytest.mark.parametrize(
    ("runner", "name", "dtype"),
    [
        (NNXRunner(), "gqa", "float32"),
        (LinenRunner(), "mqa", "float32"),
        (NNXRunner(implementation="xla"), "mqa", "float32"),
        (LinenRunner(implementation="xla"), "gqa", "bfloat16"),
    ],
    ids=lambda x: getattr(x, "name", x),
)
def test_a_compiled_step_is_traced_once_per_chunk_length_and_decodes_exactly(runner, name, dtype):
    weights, inputs = weights_of(name), inputs_of(1)
    layer = layer_of(runner, name, weights, dtype)
    expected = full_reference(weights, inputs, LENGTHS, **reference_heads(name))
    with backend.kernel_spy() as kernel_calls:
        actual, traces = compiled_decode(layer, inputs, dtype)
    assert traces == [4, 1, 3]  # the later chunks of 1 reuse the first one's program
    fused = runner.options.get("implementation") == "xla"
    assert len(kernel_calls) == (len(traces) if fused else 0)
    atol = 5e-6 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)
    if isinstance(runner, NNXRunner) and not fused:
        eager = runner.decode(layer, inputs, LENGTHS, CHUNKS, max_length=MAX_LENGTH)
        np.testing.assert_allclose(actual, eager, rtol=0, atol=1e-6)


def garbage_cache(seed, name, lengths, max_length):
    """A cache holding ``lengths`` positions, and random numbers everywhere."""
    config = CONFIGS[name]
    heads = spec.check_heads(config["num_hiddens"], config["num_heads"], **heads_of(config))
    shape = spec.cache_shape(len(lengths), max_length, heads)
    rng = np.random.default_rng(seed)
    keys, values = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    return spec.KVCache(keys, values, jnp.asarray(lengths, jnp.int32))


def as_numpy(cache):
    return spec.KVCache(*(np.asarray(x, np.float64) for x in cache[:2]), np.asarray(cache[2]))


def test_compiled_code_drops_what_overflows_and_overwrites_nothing():
    name = "gqa"
    weights, inputs = weights_of(name, seed=2), inputs_of(2)
    layer = layer_of(NNXRunner(), name, weights)
    cache = garbage_cache(2, name, [3, 1, 0], max_length=4)
    before = as_numpy(cache)
    rows = [x[:, :3] for x in inputs.values()]
    arrays = [jnp.asarray(x) for x in rows]
    # Example 0 would hold 3 + 3 = 6 of 4 positions.
    with pytest.raises(ValueError, match="overflows: example 0 would hold 6"):
        layer(*arrays, jnp.array([3, 3, 3]), causal=True, cache=cache)
    step, _ = compiled(layer)
    output, after = step(*arrays, jnp.array([3, 3, 3]), cache)
    after = as_numpy(after)
    assert after.lengths.tolist() == [6, 4, 3]  # still counting: lengths > max_length tells
    # What fits is what a call appending [1, 3, 3] keeps: example 0's first new position.
    expected, _, fitting = spec.reference_cached_forward(
        weights, *rows, before, np.array([1, 3, 3]), **reference_heads(name), causal=True
    )
    held = (np.arange(4) < fitting.lengths[:, None])[:, None, :, None]
    was_held = (np.arange(4) < before.lengths[:, None])[:, None, :, None]
    for kept, wanted, old in zip(after[:2], fitting[:2], before[:2], strict=True):
        np.testing.assert_allclose(np.where(held, kept, 0), np.where(held, wanted, 0), atol=5e-6)
        # The positions held before the call are untouched, bit for bit.
        np.testing.assert_array_equal(np.where(was_held, kept, 0), np.where(was_held, old, 0))
    # Query 0 of example 0 sees what it would have seen; examples 1 and 2 fit.
    output = np.asarray(output)
    np.testing.assert_allclose(output[0, 0], expected[0, 0], atol=5e-6)
    np.testing.assert_allclose(output[1:], expected[1:], atol=5e-6)


XLA = NNXRunner(implementation="xla")


@pytest.mark.parametrize("causal", [True, False])
def test_cached_calls_take_the_fused_kernel_as_planned(monkeypatch, causal):
    """A call that appends and one that does not, on a cache whose free positions
    hold garbage, with an example that holds nothing (its rows are fully hidden:
    the spec's mean of all ``max_length`` values, which the kernel does not give)."""
    name = "gqa"
    weights, inputs = weights_of(name, seed=3), inputs_of(3)
    layer = layer_of(XLA, name, weights)
    cache = garbage_cache(3, name, [2, 0, 1], max_length=5)
    before = as_numpy(cache)
    nan_where_nothing_is_seen(monkeypatch)
    queries, keys, values = (x[:, :2] for x in inputs.values())
    appending = (keys, values, np.array([1, 0, 2]))  # example 1 appends nothing
    for k, v, new_lens in (appending, (None, None, None)):
        expected, expected_weights, _ = spec.reference_cached_forward(
            weights, queries, k, v, before, new_lens, **reference_heads(name), causal=causal
        )
        args = [None if x is None else jnp.asarray(x) for x in (queries, k, v, new_lens)]
        plan = spec.plan_kernel(
            DOT_PRODUCT_ATTENTION,
            sizes=(3, 2, 5),
            lens_ndim=2 if causal and k is not None else 1,
            grouped=True,
        )
        assert plan.fused and plan.fix_rows
        for weights_too in (False, True):

            @nnx.jit
            def call(layer, q, k, v, lens, cache, weights_too=weights_too):
                return layer(
                    q, k, v, lens, causal=causal, cache=cache, return_attention_weights=weights_too
                )

            with backend.kernel_spy() as kernel_calls:
                output, *attention_weights, _ = call(layer, *args, cache)
            np.testing.assert_allclose(np.asarray(output), expected, rtol=0, atol=5e-6)
            if weights_too:
                assert kernel_calls == []  # the generic path
                np.testing.assert_allclose(attention_weights[0], expected_weights, atol=5e-6)
                continue
            (kernel_call,) = kernel_calls
            assert kernel_call.mask == plan.needs_mask and not kernel_call.is_causal
            assert (kernel_call.key_lengths is not None) == plan.key_lengths


@pytest.mark.parametrize("causal", [True, False])
def test_fused_gradients_of_a_prefill_are_those_of_a_full_forward(causal):
    """From an empty cache, a prefill of ``n`` real positions is one full forward
    with ``valid_lens=n``: every query sees the same keys (no row is fully hidden)."""
    name = "mqa"
    weights, inputs = weights_of(name, seed=4), inputs_of(4, batch=2, length=4)
    new_lens = np.array([4, 2])
    layer = layer_of(XLA, name, weights)
    layer.eval()
    cache = layer.init_cache(2, 6)
    cotangent = np.random.default_rng(4).standard_normal((2, 4, 6))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @jax.jit
    def pullback(params, q, k, v):
        def output(params, q, k, v):
            merged = nnx.merge(graphdef, params, rest)
            return merged(q, k, v, jnp.asarray(new_lens), causal=causal, cache=cache)[0]

        return jax.vjp(output, params, q, k, v)[1](jnp.asarray(cotangent, jnp.float32))

    with backend.kernel_spy() as kernel_calls:
        param_grads, *input_grads = pullback(params, *(jnp.asarray(x) for x in inputs.values()))
    assert len(kernel_calls) == 1
    expected = spec.reference_gradients(
        weights,
        *inputs.values(),
        new_lens,
        **reference_heads(name),
        causal=causal,
        output_gradient=cotangent,
    )
    for input_name, grad in zip(inputs, input_grads, strict=True):
        np.testing.assert_allclose(grad, expected[input_name], atol=5e-5, err_msg=input_name)
    tree = nnx.to_pure_dict(param_grads)
    for projection in ("W_q", "W_k", "W_v", "W_o"):
        np.testing.assert_allclose(tree[projection]["kernel"], expected[projection], atol=5e-5)


def primitives(jaxpr):
    """The names of the primitives in ``jaxpr`` and every jaxpr inside it."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for inner in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= primitives(inner)
    return names


def test_cached_calls_take_the_generic_path_in_pieces_on_a_cpu(monkeypatch):
    name = "gqa"
    weights, inputs = weights_of(name, seed=5), inputs_of(5)
    layer = layer_of(NNXRunner(), name, weights)
    cache = garbage_cache(5, name, [3, 1, 0], max_length=6)
    # The scores of one example (4 heads, 2 queries, 6 cached keys) fit, of two
    # do not: 3 pieces of one example.
    monkeypatch.setattr(_facts, "CPU_PIECE_BYTES", 2 * 4 * 2 * 6 * 4 - 1)
    rows = [x[:, :2] for x in inputs.values()]
    new_lens = np.array([2, 1, 0])

    def call(layer, q, k, v, lens, cache):
        return layer(q, k, v, lens, causal=True, cache=cache, return_attention_weights=True)

    args = [*(jnp.asarray(x) for x in rows), jnp.asarray(new_lens), cache]
    layer.eval()
    jaxpr = jax.make_jaxpr(lambda *args: call(layer, *args))(*args).jaxpr
    assert "scan" in primitives(jaxpr)  # lax.map over the pieces
    output, attention_weights, after = nnx.jit(call)(layer, *args)
    expected, expected_weights, _ = spec.reference_cached_forward(
        weights, *rows, as_numpy(cache), new_lens, **reference_heads(name), causal=True
    )
    np.testing.assert_allclose(np.asarray(output), expected, atol=5e-6)
    np.testing.assert_allclose(np.asarray(attention_weights), expected_weights, atol=5e-6)
    assert np.asarray(after.lengths).tolist() == [5, 2, 0]


def test_init_cache_takes_the_layers_dtype_and_needs_no_linen_variables():
    config = CONFIGS["gqa"]
    heads = heads_of(config)
    # Linen: an unbound module, its dtype over its param_dtype.
    module = linen.MultiHeadAttention(8, 4, bias=True, param_dtype=jnp.float16, **heads)
    cache = module.init_cache(3, 5)
    assert isinstance(cache, spec.KVCache)
    assert cache.keys.shape == cache.values.shape == (3, 2, 5, 2)
    assert cache.keys.dtype == jnp.float16 and cache.lengths.dtype == jnp.int32
    assert module.clone(dtype=jnp.bfloat16).init_cache(1, 2).values.dtype == jnp.bfloat16
    # NNX: a computation dtype other than the parameters' is the cache's.
    layer = MultiHeadAttention(8, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), **heads)
    cache = layer.init_cache(2, 4)
    assert cache.keys.dtype == jnp.bfloat16 and layer.W_q.kernel[...].dtype == jnp.float32
    x = jnp.ones((2, 1, 8), jnp.bfloat16)
    output, cache = nnx.jit(lambda layer, x, cache: layer(x, x, x, cache=cache))(layer, x, cache)
    assert output.dtype == jnp.bfloat16 and np.asarray(cache.lengths).tolist() == [1, 1]
    # Under nnx.jit, where the parameters are traced.
    traced = nnx.jit(lambda layer: layer.init_cache(2, 4, jnp.float32))(layer)
    assert traced.keys.dtype == jnp.float32 and traced.keys.shape == (2, 2, 4, 2)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((2.0, 4), TypeError, "batch_size must be a non-negative int"),
        ((2, -1), ValueError, "max_length must be a non-negative int"),
        ((2, 4, jnp.int32), TypeError, "floating"),
    ],
)
def test_bad_init_cache_arguments_raise(args, error, match):
    layer = MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
    for make in (layer.init_cache, linen.MultiHeadAttention(8, 2).init_cache):
        with pytest.raises(error, match=match):
            make(*args)


def test_cached_call_errors_are_raised_while_tracing():
    module = linen.MultiHeadAttention(8, 2, **SIZES)
    q, k, v = (jnp.ones((2, 1, SIZES[s])) for s in ("query_size", "key_size", "value_size"))
    variables = linen.variables_from_weights(init_weights(8, **SIZES), module)

    @jax.jit
    def step(q, k, v, cache):
        return module.apply(variables, q, k, v, causal=True, cache=cache)

    with pytest.raises(ValueError, match="cache.keys must have shape"):
        step(q, k, v, module.init_cache(3, 4))
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        step(q, k, v, list(module.init_cache(2, 4)))
    with pytest.raises(TypeError, match="cache.keys dtype float16 differs"):
        module.apply(variables, q, None, None, cache=module.init_cache(2, 4, jnp.float16))
    # A module that never saw keys cannot make W_k from a call without them.
    unsized = linen.MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="initialise the module with keys and values"):
        unsized.init(jax.random.key(0), q, None, None, cache=unsized.init_cache(2, 4))
