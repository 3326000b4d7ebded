"""Tensor parallelism over heads with JAX's sharding (docs: "Sharding heads").

The heads are split over one axis of a :class:`jax.sharding.Mesh`: ``W_q``,
``W_k`` and ``W_v`` by columns (each device holds the projections of its
heads), ``W_o`` by rows (each device holds the rows its heads' contexts
meet), ``b_o`` replicated. XLA's partitioner, given where the parameters
live, splits every operation that follows them and inserts the one
reduction after ``W_o`` (the sum of the devices' partial outputs) itself.
The generic path must keep the heads an axis of their own for that (d2l's
``(B*H, T, dh)`` would make it gather the projections): a sharded layer
computes it head by head (``head_parallel``, the same numbers; dropout
excepted, whose mask is drawn for all heads at once). A batch sharded on
another axis of the mesh (``("data", "model")``) is split the same way.

Shard ``s`` of ``n`` holds query heads ``[s H / n, (s + 1) H / n)`` and the
key/value heads they read (:func:`mha_multi.spec.shard_heads`), so ``n``
must divide ``num_heads`` and ``num_kv_heads``.

- NNX: :func:`shard_heads` places the layer's parameters in place, with
  their ``out_sharding`` metadata (``nnx.get_partition_spec``,
  ``nnx.Optimizer`` states follow it), and sets its ``head_parallel``.
- Linen: :func:`partition_specs` gives the variables' specs,
  :func:`shard_variables` places them (both also in :mod:`mha_multi.jax.linen`);
  the module is built with ``head_parallel=True``.
- The cache: a sharded NNX layer's ``init_cache`` splits the cache's
  key/value heads the same way; :func:`shard_cache` places any cache (a
  Linen module's, or one with its batch on a data axis).

The mesh axis of the heads must be of type ``Auto`` (the partitioner chooses
the layout of every intermediate); an ``Explicit`` axis would ask every
operation of the layer for its output's sharding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import linen, nnx
from flax.core import unfreeze
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from mha_multi import spec
from mha_multi.jax.layer import MultiHeadAttention
from mha_multi.weights import KERNEL_NAMES, NORM_NAMES, SINKS_NAME

__all__ = ["param_specs", "partition_specs", "shard_cache", "shard_heads", "shard_variables"]


def param_specs(axis: str = "model") -> dict[str, dict[str, PartitionSpec]]:
    """The partition spec of each projection's ``kernel`` and ``bias``, heads on ``axis``.

    Args:
        axis: the mesh axis the heads are split over.

    Returns:
        ``{"W_q": {"kernel": P(None, axis), "bias": P(axis)}, ...,
        "W_o": {"kernel": P(axis, None), "bias": P()}}``: the kernels are
        ``(in, out)`` (``x @ W + b``), so the heads are ``W_q``/``W_k``/``W_v``'s
        columns and ``W_o``'s rows.
    """
    columns = {"kernel": PartitionSpec(None, axis), "bias": PartitionSpec(axis)}
    return {
        "W_q": dict(columns),
        "W_k": dict(columns),
        "W_v": dict(columns),
        "W_o": {"kernel": PartitionSpec(axis, None), "bias": PartitionSpec()},
    }


def _check_axis(mesh: Any, axis: Any, name: str = "axis") -> int:
    """The size of mesh axis ``axis``, checked to be an ``Auto`` axis of ``mesh``."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{name}={axis!r} is not an axis of the mesh; its axes are {mesh.axis_names}"
        )
    axis_type = mesh.axis_types[mesh.axis_names.index(axis)]
    if axis_type != AxisType.Auto:
        raise ValueError(
            f"{name}={axis!r} is an {axis_type.name} axis of the mesh; sharded heads and "
            "their cache need Auto axes, whose layouts XLA chooses: make the mesh with "
            "axis_types=(jax.sharding.AxisType.Auto, ...)"
        )
    return int(mesh.shape[axis])


def _num_shards(heads: spec.Heads, mesh: Any, axis: Any) -> int:
    num_shards = _check_axis(mesh, axis)
    spec.shard_heads(heads, num_shards)
    return num_shards


def shard_heads(layer: MultiHeadAttention, mesh: Mesh, axis: str = "model") -> MultiHeadAttention:
    """Splits the heads of an NNX layer over ``axis`` of ``mesh``, in place.

    Places ``W_q``/``W_k``/``W_v`` (kernels ``(in, H*dh)`` and biases) by
    columns and ``W_o`` (``(H*dh, num_hiddens)``) by rows with
    :class:`~jax.sharding.NamedSharding`, replicates ``b_o`` and the rest of
    the layer's state (dropout rngs), and records each parameter's spec as
    its ``out_sharding`` metadata (``nnx.get_partition_spec(nnx.state(layer))``
    then reads them back, and ``nnx.Optimizer`` states are sharded alike).
    Calls, eager or under ``nnx.jit``/``nnx.grad``, are then partitioned by
    XLA; inputs may be replicated or have their batch sharded on another
    mesh axis. ``init_cache`` returns a cache whose key/value heads are split
    the same way, ``set_weights`` keeps the placement and ``get_weights``
    gathers full numpy arrays. The layer's ``head_parallel`` is set, so its
    generic path attends head by head (see the module notes).

    Args:
        layer: the layer, on any device.
        mesh: the devices; ``axis`` must be an ``Auto`` axis.
        axis: the mesh axis of the heads; its size ``n`` must divide
            ``num_heads`` and ``num_kv_heads``.

    Returns:
        ``layer`` itself.

    Raises:
        TypeError: ``layer`` is no NNX :class:`MultiHeadAttention` or
            ``mesh`` no :class:`~jax.sharding.Mesh`.
        ValueError: ``axis`` not an ``Auto`` axis of ``mesh``, or its size
            not dividing ``num_heads`` and ``num_kv_heads``
            (:func:`mha_multi.spec.shard_heads`), or a ``qk_norm`` of scope
            ``"whole"`` (its mean square spans every head).
    """
    if not isinstance(layer, MultiHeadAttention):
        raise TypeError(
            "layer must be an mha_multi.jax.MultiHeadAttention (for Linen variables use "
            f"mha_multi.jax.linen.shard_variables); got {type(layer).__name__}"
        )
    spec.refuse_whole_norm(layer.options.qk_norm, "sharding heads")
    _num_shards(layer.heads, mesh, axis)
    placed = set()
    for name, specs in param_specs(axis).items():
        linear = getattr(layer, name)
        for entry, partition in specs.items():
            param = getattr(linear, entry)
            if param is None:
                continue
            # The metadata names the layout for NNX's own tools; the value is
            # placed now, since nnx.jit reads where the arrays are.
            param.set_metadata(out_sharding=tuple(partition), mesh=mesh)
            param.set_value(jax.device_put(param[...], NamedSharding(mesh, partition)))
            placed.add(id(param))
    if layer.options.sinks:  # each head's sink logit goes with its head
        layer.sinks.set_metadata(out_sharding=(axis,), mesh=mesh)
        layer.sinks.set_value(
            jax.device_put(layer.sinks[...], NamedSharding(mesh, PartitionSpec(axis)))
        )
        placed.add(id(layer.sinks))
    layer.head_parallel = True
    # Every other array (dropout rng keys and counts) on the same devices, whole.
    replicated = NamedSharding(mesh, PartitionSpec())
    for _, variable in nnx.iter_graph(layer):
        if isinstance(variable, nnx.Variable) and id(variable) not in placed:
            value = variable.get_value()
            if isinstance(value, jax.Array):
                variable.set_value(jax.device_put(value, replicated))
    return layer


def shard_cache(
    cache: spec.KVCache, mesh: Mesh, axis: str = "model", *, batch_axis: str | None = None
) -> spec.KVCache:
    """Places a key/value cache for a head-sharded layer.

    Args:
        cache: ``KVCache(keys, values, lengths)``: keys and values ``(B,
            num_kv_heads, max_length, head_dim)``, lengths ``(B,)``.
        mesh: the layer's mesh.
        axis: the mesh axis of the heads; its size must divide ``num_kv_heads``.
        batch_axis: a mesh axis to split the batch over as well (the inputs'
            data axis), or ``None`` to keep every example on every device.

    Returns:
        The cache with keys and values split by key/value heads on ``axis``
        (and by examples on ``batch_axis``), lengths split by examples only.

    Raises:
        ValueError: an axis not an ``Auto`` axis of ``mesh``, ``batch_axis``
            equal to ``axis``, or an axis whose size does not divide what
            it splits.
    """
    num_shards = _check_axis(mesh, axis)
    cache = spec.as_kv_cache(cache)
    batch, num_kv_heads = cache.keys.shape[:2]
    if num_kv_heads % num_shards:
        raise ValueError(
            f"the number of shards ({num_shards}) must divide the cache's num_kv_heads "
            f"({num_kv_heads})"
        )
    if batch_axis is not None:
        if batch_axis == axis:
            raise ValueError(f"batch_axis must differ from axis; both are {axis!r}")
        batch_shards = _check_axis(mesh, batch_axis, "batch_axis")
        if batch % batch_shards:
            raise ValueError(
                f"batch_axis={batch_axis!r} has {batch_shards} devices, which must divide "
                f"the cache's batch size ({batch})"
            )
    heads = NamedSharding(mesh, PartitionSpec(batch_axis, axis))
    return spec.KVCache(
        jax.device_put(cache.keys, heads),
        jax.device_put(cache.values, heads),
        jax.device_put(cache.lengths, NamedSharding(mesh, PartitionSpec(batch_axis))),
    )


def partition_specs(variables: Mapping[str, Any], axis: str = "model") -> dict[str, Any]:
    """The partition specs of a Linen module's variables, heads on ``axis``.

    Args:
        variables: ``{'params': {'W_q': {'kernel': ...}, ...}}`` as ``init``
            or :func:`mha_multi.jax.linen.variables_from_weights` return
            them, or the ``params`` collection itself.
        axis: the mesh axis the heads are split over.

    Returns:
        A pytree of the structure of ``variables`` with a
        :class:`~jax.sharding.PartitionSpec` at each leaf (see
        :func:`param_specs`), for ``jax.device_put(variables,
        jax.tree.map(lambda p: NamedSharding(mesh, p), specs))`` or the
        ``in_shardings`` of ``jax.jit``.

    Raises:
        ValueError: a variable that is not one of the module's projections, named.
    """
    specs = param_specs(axis)
    variables = unfreeze(variables)
    wrapped = "params" in variables
    params = variables["params"] if wrapped else variables
    result: dict[str, Any] = {}
    for name, entries in params.items():
        if name in NORM_NAMES:  # a per-head norm's weights serve every head: whole on each
            result[name] = PartitionSpec()
            continue
        if name == SINKS_NAME:  # (num_heads,): split with the heads
            result[name] = PartitionSpec(axis)
            continue
        if name not in KERNEL_NAMES:
            raise ValueError(
                f"params/{name} is not a projection of mha_multi's MultiHeadAttention "
                f"({', '.join(KERNEL_NAMES)})"
            )
        result[name] = {}
        for entry in entries:
            if entry not in specs[name]:
                raise ValueError(f"params/{name}/{entry} is neither a kernel nor a bias")
            result[name][entry] = specs[name][entry]
    if not wrapped:
        return result
    # Any other collection is replicated.
    others = {key: jax.tree.map(lambda _: PartitionSpec(), val) for key, val in variables.items()}
    return {**others, "params": result}


def shard_variables(
    module: linen.Module,
    variables: Mapping[str, Any],
    mesh: Mesh,
    axis: str = "model",
) -> dict[str, Any]:
    """A Linen module's variables placed with their heads split over ``axis`` of ``mesh``.

    The Linen counterpart of :func:`shard_heads`: ``module.apply`` (under
    ``jax.jit`` or not) on the result is partitioned by XLA. A Linen module
    is immutable: build it with ``head_parallel=True``, or its generic path
    gathers the projections (see the module notes).

    Args:
        module: the Linen :class:`mha_multi.jax.linen.MultiHeadAttention`,
            for its head layout.
        variables: its variables (see :func:`partition_specs`).
        mesh: the devices; ``axis`` must be an ``Auto`` axis.
        axis: the mesh axis of the heads; its size must divide
            ``num_heads`` and ``num_kv_heads``.

    Returns:
        New variables, the same arrays placed with
        :class:`~jax.sharding.NamedSharding`.

    Raises:
        ValueError: see :func:`shard_heads` and :func:`partition_specs`.
    """
    spec.refuse_whole_norm(module.layer_options().qk_norm, "sharding heads")
    _num_shards(module.heads, mesh, axis)
    shardings = jax.tree.map(
        lambda partition: NamedSharding(mesh, partition), partition_specs(variables, axis)
    )
    return jax.device_put(unfreeze(variables), shardings)
