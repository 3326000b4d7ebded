"""JAX's cache write (one scatter of the new rows) against the spec's update in numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mha_multi import spec
from mha_multi.jax import MultiHeadAttention
from mha_multi.jax._cache import scatter_update

HEAD_DIM, KV_HEADS, MAX_LENGTH, NEW = 2, 2, 6, 3
# Traced lengths are not checked: an example that overflows, one below 0,
# one that fills the cache exactly, one empty.
LENGTHS = np.array([5, -2, 3, 0], np.int32)


def _arrays(seed):
    rng = np.random.default_rng(seed)
    shape = (len(LENGTHS), KV_HEADS, MAX_LENGTH, HEAD_DIM)
    held = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    new = [
        rng.standard_normal((len(LENGTHS), NEW, KV_HEADS * HEAD_DIM)).astype(np.float32)
        for _ in range(2)
    ]
    return spec.KVCache(*held, LENGTHS), new


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("valid_lens", [None, np.array([7, -3, 2, 1], np.int32)])
def test_the_scatter_writes_the_specs_update_for_any_lengths(causal, valid_lens):
    cache, (k, v) = _arrays(0)
    expected, expected_lens = spec.update_cache(
        spec.NumpyOps(), cache, k, v, valid_lens, head_dim=HEAD_DIM, causal=causal
    )

    @jax.jit
    def write(cache, k, v, valid_lens):
        return scatter_update(cache, k, v, valid_lens, causal=causal)

    as_jax = spec.KVCache(*(jnp.asarray(x) for x in cache))
    lens = None if valid_lens is None else jnp.asarray(valid_lens)
    actual, actual_lens = write(as_jax, jnp.asarray(k), jnp.asarray(v), lens)
    for got, wanted in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(got), wanted)  # copies: bit for bit
    np.testing.assert_array_equal(np.asarray(actual_lens), expected_lens)


def test_the_gradient_of_a_row_is_that_of_the_position_it_lands_at():
    cache, (k, v) = _arrays(1)
    weights = np.random.default_rng(2).standard_normal(cache.keys.shape).astype(np.float32)

    def loss(k):
        as_jax = spec.KVCache(*(jnp.asarray(x) for x in cache))
        updated, _ = scatter_update(as_jax, k, jnp.asarray(v), None, causal=True)
        return (updated.keys * weights).sum()

    grad = np.asarray(jax.grad(loss)(jnp.asarray(k)))
    expected = np.zeros_like(k)
    for b, start in enumerate(LENGTHS.tolist()):
        for t in range(NEW):
            if 0 <= start + t < MAX_LENGTH:  # dropped rows take no gradient
                expected[b, t] = weights[b, :, start + t].reshape(-1)
    np.testing.assert_array_equal(grad, expected)


def test_a_compiled_rotary_step_scatters_its_rows_and_gathers_nothing():
    """A gather over every cache position would recompute the rows' rotation at
    each of them (docs: "Generating with a cache")."""
    layer = MultiHeadAttention(8, 2, num_kv_heads=1, rotary={"theta": 10000.0})
    layer.eval()
    cache = layer.init_cache(2, MAX_LENGTH)
    token = jnp.ones((2, 1, 8), jnp.float32)
    graph, state = nnx.split(layer)

    def step(state, x, cache):
        return nnx.merge(graph, state)(x, x, x, causal=True, cache=cache)

    program = str(jax.make_jaxpr(step)(state, token, cache))
    assert "scatter" in program
    assert "gather" not in program
