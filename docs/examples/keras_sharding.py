"""Keras 3: heads sharded over 4 devices with keras.distribution.ModelParallel.

On the JAX backend, W_q, W_k, W_v are split by heads (columns) and W_o by rows
along the mesh's "model" axis, the data along its "batch" axis; the sharded
layer gives the float64 reference's numbers, and so does a cached decode.
On the CPU, 4 devices need XLA_FLAGS=--xla_force_host_platform_device_count=4
before JAX starts: with fewer, the example runs itself again in a process
that sets it. On TensorFlow and PyTorch, Keras lays no variable out by a
distribution, and layout_map says so.
"""

import os
import subprocess
import sys

import keras
import numpy as np

from mha_multi.keras import MultiHeadAttention, layout_map, set_weights
from mha_multi.spec import reference_forward
from mha_multi.weights import init_weights

num_hiddens, num_heads, num_kv_heads = 32, 4, 2  # grouped-query attention
weights = init_weights(num_hiddens, bias=True, num_heads=num_heads, num_kv_heads=num_kv_heads)

if keras.backend.backend() != "jax":
    mesh = keras.distribution.DeviceMesh((1,), ["model"], devices=["cpu:0"])
    try:
        layout_map(mesh)
    except NotImplementedError as error:
        print(error)  # ... shards variables ... on its JAX backend only ...
    else:
        raise AssertionError("layout_map must refuse a backend that would not shard")
elif len(keras.distribution.list_devices()) < 4:
    flag = "--xla_force_host_platform_device_count=4"
    if flag in os.environ.get("XLA_FLAGS", ""):  # (the run again, still short: no loop)
        sys.exit(f"XLA_FLAGS holds {flag}, yet there are fewer devices: check XLA_FLAGS")
    flags = f"{os.environ.get('XLA_FLAGS', '')} {flag}"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "KERAS_BACKEND": "jax"}
    subprocess.run([sys.executable, __file__], env=env, check=True)
else:
    # [shard]
    devices = keras.distribution.list_devices()[:4]
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=devices)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map(mesh, axis="model"), batch_dim_name="batch"
    )
    with distribution.scope():  # variables made here are laid out by the map
        layer = MultiHeadAttention(num_hiddens, num_heads, num_kv_heads=num_kv_heads, bias=True)
        layer = set_weights(layer, weights)
    # [/shard]
    for name in ("W_q", "W_k", "W_o", "b_o"):
        value = getattr(layer, name).value
        print(name, value.shape, "per device:", value.sharding.shard_shape(value.shape))
    # W_q (32, 32) per device: (32, 16)  <- 2 query heads of 4 on each "model" slice
    # W_k (32, 16) per device: (32, 8)   <- 1 key/value head of 2
    # W_o (32, 32) per device: (16, 32)  <- the rows of its own heads
    # b_o (32,) per device: (32,)        <- replicated
    assert layer.W_q.value.sharding.shard_shape((32, 32)) == (32, 16)
    assert layer.W_o.value.sharding.shard_shape((32, 32)) == (16, 32)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6, num_hiddens), dtype=np.float32)
    lengths = np.array([6, 4, 5, 2])
    # [call]
    x_split = keras.distribution.distribute_tensor(x, distribution.get_data_layout(x.shape))
    out = layer(x_split, x_split, x_split, lengths, causal=True)  # (4, 6, 32), split by examples
    # [/call]
    expected, _ = reference_forward(
        weights, x, x, x, lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=True
    )
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=5e-6)

    # A cache made under the distribution keeps each device's own heads (and examples).
    with distribution.scope():
        cache = layer.init_cache(batch_size=4, max_length=8)
    per_device = cache.keys.sharding.shard_shape(cache.keys.shape)
    print("cache keys", cache.keys.shape, "per device:", per_device)  # (4, 2, 8, 8) (2, 1, 8, 8)
    assert per_device == (2, 1, 8, 8)
    outputs = []
    for t in range(6):  # one position at a time
        token = x[:, t : t + 1]
        step, cache = layer(token, token, token, causal=True, cache=cache)
        outputs.append(np.asarray(step))
    full, _ = reference_forward(
        weights, x, x, x, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=True
    )
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full, rtol=0, atol=5e-6)
