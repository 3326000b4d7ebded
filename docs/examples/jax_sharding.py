"""Flax: heads sharded over 4 devices (2-D mesh: batch on "data", heads on "model")."""

import os
import subprocess
import sys

import jax

if jax.device_count() < 4:
    # JAX fixes its CPU devices when it starts: 4 of them need
    # XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax is
    # imported. Where it started with fewer (the docs' test run), the example
    # runs again in a fresh interpreter that sets the flag.
    flag = "--xla_force_host_platform_device_count=4"
    if flag in os.environ.get("XLA_FLAGS", ""):  # (the run again, still short: no loop)
        sys.exit(f"XLA_FLAGS holds {flag}, yet JAX sees {jax.device_count()}: check XLA_FLAGS")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " " + flag
    subprocess.run([sys.executable, __file__], env=env, check=True)
else:
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from mha_multi.jax import MultiHeadAttention, get_weights, linen, set_weights, shard_heads
    from mha_multi.spec import reference_forward
    from mha_multi.weights import init_weights

    num_hiddens, num_heads, num_kv_heads = 64, 4, 2
    weights = init_weights(num_hiddens, num_heads=num_heads, num_kv_heads=num_kv_heads)
    layer = MultiHeadAttention(num_hiddens, num_heads, num_kv_heads=num_kv_heads)
    set_weights(layer, weights).eval()

    # [shard]
    # Auto axes: XLA chooses the layout of everything the parameters meet.
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    shard_heads(layer, mesh, axis="model")  # in place: 2 query heads, 1 kv head per device
    print(layer.W_q.kernel.sharding.spec, layer.W_o.kernel.sharding.spec)
    # P(None, 'model') P('model', None)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6, num_hiddens), dtype=np.float32)
    valid_lens = np.array([6, 3, 5, 1])
    batch = NamedSharding(mesh, P("data"))  # examples split over "data"
    out = nnx.jit(lambda layer, x, n: layer(x, x, x, n, causal=True))(
        layer, jax.device_put(x, batch), jax.device_put(valid_lens, batch)
    )
    print(out.sharding.spec)  # P('data',): examples split, hiddens whole on each device
    # [/shard]
    assert tuple(out.sharding.spec) in (("data",), ("data", None, None))
    shards = {s.data.shape for s in layer.W_q.kernel[...].addressable_shards}
    assert shards == {(num_hiddens, num_hiddens // 2)}  # each device: half of W_q's columns
    expected, _ = reference_forward(
        weights, x, x, x, valid_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=True
    )
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=5e-6)
    # get_weights gathers the shards into whole numpy arrays.
    assert all(np.array_equal(get_weights(layer)[k], v) for k, v in weights.items())

    # [cache]
    cache = layer.init_cache(batch_size=4, max_length=8)  # kv heads split like W_k's columns
    print(cache.keys.sharding.spec)  # P(None, 'model')
    step = nnx.jit(lambda layer, x, n, cache: layer(x, x, x, n, causal=True, cache=cache))
    prefill, cache = step(layer, x[:, :4], np.minimum(valid_lens, 4), cache)
    # [/cache]
    assert tuple(cache.keys.sharding.spec)[:2] == (None, "model")
    np.testing.assert_allclose(
        np.asarray(prefill)[0], expected[0, :4], rtol=0, atol=5e-6
    )  # example 0 has all 6 positions: its first 4 are those of the full call

    # [linen]
    module = linen.MultiHeadAttention(num_hiddens, num_heads, num_kv_heads=num_kv_heads)
    variables = linen.variables_from_weights(weights, module)
    print(linen.partition_specs(variables)["params"]["W_o"])
    # {'kernel': P('model', None)}
    variables = linen.shard_variables(module, variables, mesh)
    linen_out = jax.jit(lambda v, x, n: module.apply(v, x, x, x, n, causal=True))(
        variables, jax.device_put(x, batch), jax.device_put(valid_lens, batch)
    )
    # [/linen]
    np.testing.assert_allclose(np.asarray(linen_out), expected, rtol=0, atol=5e-6)
