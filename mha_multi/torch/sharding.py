"""Tensor parallelism over heads on PyTorch's own engine (docs: "Sharding heads").

:func:`shard_heads` splits a :class:`~mha_multi.torch.MultiHeadAttention`
over the processes of a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh`
with :func:`torch.distributed.tensor.parallel.parallelize_module`: ``W_q``,
``W_k`` and ``W_v`` column-wise (:class:`~torch.distributed.tensor.parallel.ColwiseParallel`,
each process projects its own heads; a layer's ``sinks`` split with its heads), ``W_o`` row-wise
(:class:`~torch.distributed.tensor.parallel.RowwiseParallel`, whose output is
the one all-reduce of the layer). Attention between the projections runs on
each process's own heads as ordinary tensors: it needs no communication, so
the fused and generic paths, grouped heads, ``valid_lens``, ``causal`` and
the cache work unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from mha_multi import spec
from mha_multi.torch._ops import autocasting, needs_float32_copies, product_dtype
from mha_multi.torch.layer import MultiHeadAttention

__all__ = ["shard_heads"]


@dataclasses.dataclass(frozen=True)
class HeadSharding:
    """How a layer's heads are split; kept on a sharded layer as ``layer._sharding``.

    Attributes:
        mesh: the 1-D device mesh the heads are split over.
        heads: the layer's full head layout (the canonical weights' shapes).
        local: the heads each process computes (:func:`mha_multi.spec.shard_heads`).
        index: this process's position on the mesh: it holds query heads
            ``[index * local.num_heads, (index + 1) * local.num_heads)``.
    """

    mesh: DeviceMesh
    heads: spec.Heads
    local: spec.Heads
    index: int

    @property
    def num_shards(self) -> int:
        """The number of processes the heads are split over."""
        return self.mesh.size()

    def local_head_mask(self, head_mask: torch.Tensor) -> torch.Tensor:
        """This process's gates ``(..., local heads)`` out of a full ``(..., num_heads)`` mask.

        The slice is a redistribution from replicated to sharded on the
        heads' axis, so its backward pass all-gathers the gates' gradient:
        every process gets the full ``(..., num_heads)`` gradient, as the
        unsharded layer gives it.
        """
        axis = head_mask.dim() - 1
        full = DTensor.from_local(head_mask, self.mesh, [Replicate()], run_check=False)
        return full.redistribute(self.mesh, [Shard(axis)]).to_local()

    def replicated(self, parameter: torch.Tensor) -> torch.Tensor:
        """A parameter every process holds whole (a per-head norm's weights), as this
        process's computation uses it: its gradient sums every process's (an all-reduce
        in the backward pass), as the unsharded layer's sums every head's."""
        full = DTensor.from_local(parameter, self.mesh, [Replicate()], run_check=False)
        return full.to_local(grad_placements=[Partial()])

    def check_inputs(self, queries: torch.Tensor, layer: MultiHeadAttention) -> None:
        """Refuses the products the sharded projections cannot compute to the spec.

        Raises:
            TypeError: 16-bit products on a device whose kernels may
                accumulate in 16 bits (the CPU): the unsharded layer computes
                them on float32 copies of its weights and rounds once, which
                the sharded projections (modules whose weights are
                distributed tensors) do not.
        """
        weight = layer.W_o.weight
        if needs_float32_copies(queries, weight):
            device = queries.device.type
            cast = " under torch.autocast" if autocasting(device) else ""
            raise TypeError(
                f"a head-sharded layer computes 16-bit products only where they accumulate in "
                f"float32 (CUDA); got {product_dtype(queries, weight)} products{cast} of "
                f"{queries.dtype} queries and {weight.dtype} weights on {device}: use float32 "
                'there (docs: "Sharding heads")'
            )

    @staticmethod
    def local_sinks(sinks: torch.Tensor) -> torch.Tensor:
        """This process's heads' sink logits, of a parameter sharded with the heads
        (differentiable: the gradient comes back to the shard)."""
        return sinks.to_local() if isinstance(sinks, DTensor) else sinks

    @staticmethod
    def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
        """The whole of a sharded parameter (an all-gather: every process must call it)."""
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def distribute_like(self, parameter: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """The full ``tensor`` split as ``parameter`` is, or whole where every process holds
        the parameter whole (a per-head norm's weights): process 0's values, scattered or
        broadcast."""
        tensor = tensor.to(device=parameter.device, dtype=parameter.dtype)
        if not isinstance(parameter, DTensor):
            return distribute_tensor(tensor, self.mesh, [Replicate()]).to_local()
        return distribute_tensor(tensor, parameter.device_mesh, parameter.placements)


def shard_heads(layer: MultiHeadAttention, device_mesh: DeviceMesh) -> MultiHeadAttention:
    """Splits ``layer``'s heads over the processes of ``device_mesh``, in place.

    Tensor parallelism over heads (docs: "Sharding heads") through
    :func:`torch.distributed.tensor.parallel.parallelize_module`: ``W_q``,
    ``W_k`` and ``W_v`` are split by output columns (``ColwiseParallel``),
    so process ``s`` of ``n`` projects query heads ``[s * H / n, (s + 1) *
    H / n)`` and the key/value heads they read; ``W_o`` is split by input
    rows (``RowwiseParallel``) and its partial outputs are summed by one
    all-reduce. Call it on every process of the mesh with the same layer
    (process 0's weights are the ones distributed); run the processes with
    ``torchrun``, the ``gloo`` backend on CPU, ``nccl`` on GPU.

    The sharded layer takes the same calls as the unsharded one, with every
    input (queries, keys, values, ``valid_lens``, ``head_mask``) whole on
    every process, and returns the whole output ``(B, Q, num_hiddens)`` on
    every process. Afterwards:

    - ``layer.num_heads``, ``layer.num_kv_heads`` are this process's head
      counts (``H / n``, ``H_kv / n``); the attention weights a call
      returns are this process's heads ``(B, H / n, Q, K)``.
    - ``head_mask`` is still the full ``(H,)`` or ``(B, H)``: each process
      gates its own heads, and the mask's gradient is the full one on every
      process.
    - ``layer.init_cache`` makes a cache of this process's key/value heads
      ``(B, H_kv / n, max_length, head_dim)``.
    - :func:`~mha_multi.torch.get_weights` returns the full canonical
      weights (gathered) and :func:`~mha_multi.torch.set_weights` takes the
      full canonical weights (process 0's are distributed): both are
      collectives, to be called on every process.
    - Parameters are :class:`~torch.distributed.tensor.DTensor`; their
      ``.grad`` too (``.full_tensor()`` gathers one).
    - Inputs must be float32, or 16-bit on CUDA (a ``TypeError`` otherwise:
      the CPU's 16-bit products are computed on float32 copies of whole
      weights, which the sharded modules do not do).
    - :func:`~mha_multi.torch.head_importance` of a sharded layer is the
      whole layer's ``(num_heads,)``, on every process (call it on each).

    Args:
        layer: a layer whose input sizes are known (given to the constructor,
            or fixed by a first call or by ``set_weights``), on the mesh's
            device type.
        device_mesh: a 1-D mesh, e.g. ``init_device_mesh("cpu", (world_size,))``.

    Returns:
        ``layer`` itself, sharded.

    Raises:
        TypeError: ``layer`` is not a ``MultiHeadAttention`` or
            ``device_mesh`` not a ``DeviceMesh``.
        ValueError: the mesh is not 1-D, its size does not divide
            ``num_heads`` and ``num_kv_heads`` (:func:`mha_multi.spec.shard_heads`),
            an input size is still lazy, the layer is already sharded or has
            ``qk_norm`` of scope ``"whole"`` (its mean square spans every head) or
            ``alibi`` (its bias spans every head), its
            parameters are not on the mesh's device type, or this process
            is not part of the mesh.
    """
    if not isinstance(layer, MultiHeadAttention):
        raise TypeError(
            f"layer must be a mha_multi.torch.MultiHeadAttention; got {type(layer).__name__}"
        )
    spec.refuse_whole_norm(layer.options.qk_norm, "sharding heads")
    if layer.options.alibi:
        raise ValueError(
            "sharding heads is not possible with alibi: its bias spans every head, and a "
            'layer whose heads are sharded takes no bias (docs: "Sharding heads")'
        )
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh; "
            f"got {type(device_mesh).__name__}"
        )
    if layer._sharding is not None:
        raise ValueError(
            f"the layer's heads are already sharded {layer._sharding.num_shards} ways; "
            "shard an unsharded layer"
        )
    if device_mesh.ndim != 1:
        # parallelize_module takes 1-D meshes: a tensor-parallel dimension of a
        # larger mesh is sliced out by name, e.g. mesh["tp"].
        raise ValueError(
            f"device_mesh must be 1-D (the processes the heads are split over); got a "
            f"{device_mesh.ndim}-D mesh of shape {tuple(device_mesh.shape)}: pass one "
            "dimension of it, e.g. mesh['tp']"
        )
    local = spec.shard_heads(layer._heads, device_mesh.size())
    lazy = [name for name, size in layer.input_sizes().items() if size is None]
    if lazy:
        raise ValueError(
            f"{', '.join(lazy)} not known yet: pass them to the constructor, call the layer "
            "once or load weights with set_weights before sharding it"
        )
    device_type = layer.W_o.weight.device.type
    if device_type != device_mesh.device_type:
        raise ValueError(
            f"the layer's parameters are on {device_type}, the mesh on "
            f"{device_mesh.device_type}: move the layer first (layer.to(...))"
        )
    coordinate = device_mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this process is not part of device_mesh: call shard_heads on its ranks")
    plan = {
        "W_q": ColwiseParallel(),
        "W_k": ColwiseParallel(),
        "W_v": ColwiseParallel(),
        "W_o": RowwiseParallel(),
    }
    parallelize_module(layer, device_mesh, plan)
    if layer.options.sinks:  # each head's sink logit goes with its head
        sinks = distribute_tensor(layer.sinks.data, device_mesh, [Shard(0)])
        layer.sinks = torch.nn.Parameter(sinks, requires_grad=layer.sinks.requires_grad)
    if layer.options.qk_norm is not None:  # every process holds the norms whole: process 0's
        with torch.no_grad():
            for name in spec.QK_NORM_NAMES:
                held = layer._parameters[name]
                held.copy_(distribute_tensor(held.detach(), device_mesh, [Replicate()]).to_local())
    layer._sharding = HeadSharding(device_mesh, layer._heads, local, coordinate[0])
    layer._heads = local
    layer.num_heads = local.num_heads
    layer.num_kv_heads = local.num_kv_heads
    return layer
