"""Tensor parallelism over heads with Keras' own distribution API (docs: "Sharding heads").

:func:`layout_map` gives the :class:`keras.distribution.LayoutMap` that
splits :class:`~mha_multi.keras.MultiHeadAttention` by heads for
:class:`keras.distribution.ModelParallel`: ``W_q``, ``W_k``, ``W_v`` (and
``b_q``, ``b_k``, ``b_v``) by columns, ``W_o`` by rows, ``b_o`` replicated.
Each device then holds whole heads, computes their attention, and XLA adds
the devices' partial ``W_o`` products in one reduction. Keras' JAX backend
places the variables and ``jax.jit`` partitions the computation; nothing
here moves data itself.

Where the head counts are checked: a ``LayoutMap`` is made before the layers
it lays out, so the layer checks its own variables when it creates them
(:func:`check_variable_layout`, called by the layer): under a distribution
that splits its heads over ``n`` devices, ``n`` must divide ``num_heads`` and
``num_kv_heads`` (:func:`mha_multi.spec.shard_heads`), else a ``ValueError``
names the variable, the mesh axis and both counts before Keras lays anything
out. ``layout_map(..., layer=layer)`` checks ``layer``'s counts at once.

Keras 3.15 lays variables out by a distribution on its JAX backend only: on
TensorFlow a ``ModelParallel`` distribution is accepted and ignored (every
variable stays whole on one device) and on PyTorch Keras has no distribution
backend at all (``keras.distribution.list_devices`` fails). So
:func:`layout_map` raises a ``NotImplementedError`` naming the backend there,
rather than give a map that would silently shard nothing.

The layer calls the helpers here, so this module imports no layer: the
layers it takes are typed ``Any``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import keras

from mha_multi import spec

__all__ = [
    "HEAD_AXES",
    "SUPPORTED_BACKENDS",
    "cache_layout",
    "check_backend",
    "check_variable_layout",
    "layout_map",
]

#: Keras backends whose variables follow ``keras.distribution`` layouts.
SUPPORTED_BACKENDS: frozenset[str] = frozenset({"jax"})

#: Variable name -> the axis of that variable that runs over heads (``b_o``:
#: none, it is replicated).
HEAD_AXES: dict[str, int] = {
    "W_q": 1,
    "W_k": 1,
    "W_v": 1,
    "b_q": 0,
    "b_k": 0,
    "b_v": 0,
    "W_o": 0,
    "sinks": 0,
}


def check_backend() -> None:
    """Raises ``NotImplementedError`` on a Keras backend that ignores variable layouts."""
    backend = keras.backend.backend()
    if backend not in SUPPORTED_BACKENDS:
        raise NotImplementedError(
            f"Keras {keras.__version__} shards variables with keras.distribution on its JAX "
            f"backend only; this process runs the {backend!r} backend, where a ModelParallel "
            "distribution would leave every variable whole (set KERAS_BACKEND=jax)"
        )


def layout_map(
    device_mesh: keras.distribution.DeviceMesh,
    *,
    axis: str = "model",
    layer: Any = None,
    name: str | None = None,
) -> keras.distribution.LayoutMap:
    """The layout that splits :class:`~mha_multi.keras.MultiHeadAttention` by heads.

    For ``keras.distribution.ModelParallel(layout_map=..., batch_dim_name=...)``
    on Keras' JAX backend: with ``n = device_mesh`` size along ``axis``,
    ``W_q`` ``(query_size, H*dh)``, ``W_k``/``W_v`` ``(·, H_kv*dh)`` and
    their biases are split into ``n`` column blocks (shard ``s`` holds query
    heads ``s*H/n ..`` and key/value heads ``s*H_kv/n ..``), ``W_o`` ``(H*dh,
    num_hiddens)`` into ``n`` row blocks, and ``b_o`` is replicated. The
    other mesh axes replicate the variables (a ``"batch"`` axis then splits
    the data, Keras' ``batch_dim_name``).

    The keys are regular expressions on variable paths (``<parents>/<layer
    name>/W_q``), so they match the layers wherever they are nested. The map
    is a plain ``LayoutMap``: add keys for the model's other variables to it.

    Args:
        device_mesh: the ``keras.distribution.DeviceMesh``.
        axis: the mesh axis the heads are split along.
        layer: a layer to lay out (or one of the same name and heads, e.g.
            the one whose config the model is rebuilt from): only the layers
            of its name match, and its head counts are checked now.
        name: the name of the layers to lay out (``None``: ``layer``'s, or
            every ``MultiHeadAttention``, whatever its name).

    Returns:
        A ``keras.distribution.LayoutMap`` on ``device_mesh``.

    Raises:
        NotImplementedError: the Keras backend is not JAX (see the module).
        TypeError: ``device_mesh`` is not a ``DeviceMesh``, or ``axis`` or
            ``name`` not a string.
        ValueError: ``axis`` is not an axis of the mesh, ``name`` differs from
            ``layer.name``, or the mesh's size along ``axis`` does not divide
            ``layer``'s ``num_heads`` and ``num_kv_heads``.
    """
    check_backend()
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise TypeError(
            f"device_mesh must be a keras.distribution.DeviceMesh; got {type(device_mesh).__name__}"
        )
    if not isinstance(axis, str):
        raise TypeError(f"axis must be a mesh axis name (str); got {axis!r}")
    if axis not in device_mesh.axis_names:
        raise ValueError(
            f"axis {axis!r} is not an axis of the device mesh; its axes are "
            f"{list(device_mesh.axis_names)}"
        )
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a layer name (str) or None; got {name!r}")
    if layer is not None:
        if name is not None and name != layer.name:
            raise ValueError(f"name {name!r} differs from layer.name {layer.name!r}")
        name = layer.name
        num_shards = device_mesh.shape[list(device_mesh.axis_names).index(axis)]
        spec.shard_heads(layer._heads, num_shards)
        if num_shards > 1:
            spec.refuse_whole_norm(layer.options.qk_norm, "sharding heads")
    # Keras matches a path with re.fullmatch; a variable's path has at least
    # its layer's name before it, and parents (models, blocks) before that.
    prefix = ".*/" if name is None else f"(?:.*/)?{re.escape(name)}/"
    layouts = keras.distribution.LayoutMap(device_mesh)
    for projection in "qkv":
        layouts[f"{prefix}W_{projection}"] = (None, axis)
        layouts[f"{prefix}b_{projection}"] = (axis,)
    layouts[f"{prefix}W_o"] = (axis, None)
    layouts[f"{prefix}sinks"] = (axis,)  # each head's sink logit goes with its head
    return layouts


def _distribution() -> Any:
    """The active Keras distribution where it lays variables out, else ``None``."""
    if keras.backend.backend() not in SUPPORTED_BACKENDS:
        return None  # Keras would ignore it: nothing is split
    return keras.distribution.distribution()


def _layout(distribution: Any, path: str) -> Any:
    try:
        return distribution.get_tensor_layout(path)
    except NotImplementedError:  # a Distribution that lays out no tensor by path
        return None


def _shards(layout: Any, distribution: Any, dim: int) -> tuple[int, tuple[str, ...]]:
    """The number of blocks ``layout`` splits dimension ``dim`` into, and the mesh axes."""
    entry = layout.axes[dim] if dim < len(layout.axes) else None
    if entry is None:
        return 1, ()
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    mesh = layout.device_mesh or distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    return math.prod(sizes[n] for n in names), names


def check_variable_layout(layer: Any, name: str, path: str) -> int:
    """Checks that the active distribution keeps each of ``layer``'s heads on one device.

    Called by the layer before and after it creates its variable ``name``
    (``W_q``...), with the variable's path (before: the path it will have, as
    far as the layer knows it). Layers made without a distribution, or on a
    backend that ignores it, pass.

    Returns:
        The number of blocks the distribution splits the variable's heads
        into (1 where it splits nothing).

    Raises:
        ValueError: the layout of ``path`` splits the variable's head axis
            into a number of blocks that does not divide ``num_heads`` and
            ``num_kv_heads`` (:func:`mha_multi.spec.shard_heads`).
    """
    if name not in HEAD_AXES:
        return 1
    distribution = _distribution()
    if distribution is None:
        return 1
    layout = _layout(distribution, path)
    if layout is None:
        return 1
    num_shards, axes = _shards(layout, distribution, HEAD_AXES[name])
    if num_shards > 1:
        spec.refuse_whole_norm(layer.options.qk_norm, "sharding heads")
    try:
        spec.shard_heads(layer._heads, num_shards)
    except ValueError as error:
        raise ValueError(
            f"layer {layer.name!r}: the distribution splits {name} ({path}) over mesh axes "
            f"{list(axes)} into {num_shards} blocks, which would split heads: {error}"
        ) from None
    return num_shards


def head_vmap() -> Any:
    """The map :func:`mha_multi.spec.attention_by_kv_heads` takes: ``jax.vmap``.

    Only Keras' JAX backend lays variables out by a distribution, so only
    its layers are ever head-parallel (docs: "Sharding heads").
    """
    import jax

    return jax.vmap


def cache_layout(layer: Any, batch_size: int) -> Any:
    """The ``keras.distribution.TensorLayout`` of ``layer``'s cache keys and values, or ``None``.

    Under a distribution that splits ``W_k`` by heads, the cache's
    ``(B, H_kv, max_length, head_dim)`` keys and values are split the same
    way over their heads, so that each device holds the keys and values of
    its own heads; and over the distribution's batch axis too where its size
    divides ``batch_size``, as the data is. ``None`` without such a
    distribution (the cache is then made as without one).
    """
    distribution = _distribution()
    if distribution is None:
        return None
    path = f"{layer.path or layer.name}/W_k" if layer.W_k is None else layer.W_k.path
    layout = _layout(distribution, path)
    if layout is None:
        return None
    _, heads = _shards(layout, distribution, HEAD_AXES["W_k"])
    if not heads:
        return None
    mesh = layout.device_mesh or distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    batch = getattr(distribution, "batch_dim_name", None)
    if batch not in sizes or batch in heads or batch_size % sizes[batch]:
        batch = None
    head_axes = heads[0] if len(heads) == 1 else heads
    return keras.distribution.TensorLayout((batch, head_axes, None, None), mesh)
