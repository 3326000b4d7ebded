"""PyTorch's facts, once: dtypes, devices, precision settings, conversions and calls.

The parity runner, the benchmark and the tests reach PyTorch through this
module (docs: "Architecture"): how a device name maps to a ``torch.device``,
which process-wide settings give exact float32 products, how tensors leave
for numpy, how the layer is built, called and differentiated, and how a call
of its fused kernel is observed. The native layer is
``torch.nn.MultiheadAttention`` (:func:`native_layer`).

The layer imports this module, so the layer is imported here only inside the
functions that build one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mha_multi.weights import KERNEL_NAMES

if TYPE_CHECKING:
    from mha_multi.parity.runners import KernelCall
    from mha_multi.spec import KVCache
    from mha_multi.torch.layer import MultiHeadAttention

__all__ = [
    "DTYPES",
    "device",
    "device_description",
    "exact_float32",
    "forward",
    "gpu_available",
    "head_mask_gradient",
    "host_array",
    "init_cache",
    "kernel_spy",
    "lens_to_native",
    "make_layer",
    "native_layer",
    "sync",
    "to_native",
    "to_numpy",
    "vjp",
]

#: dtype name -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

INPUT_NAMES = ("queries", "keys", "values")
#: ``scaled_dot_product_attention``'s leading positional parameters.
_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


# -- devices and precision -----------------------------------------------------


def device(name: str) -> torch.device:
    """The ``torch.device`` of a device name.

    Args:
        name: ``"cpu"`` or ``"gpu"`` (the first CUDA device).
    """
    return torch.device("cuda" if name == "gpu" else "cpu")


# Parameters named ``device`` shadow the function above inside the functions below.
_device = device


def gpu_available() -> bool:
    """Whether a CUDA device can run here."""
    return torch.cuda.is_available()


def device_description(name: str) -> str:
    """The device as reports name it: the GPU's model, or ``"cpu"``."""
    return torch.cuda.get_device_name() if name == "gpu" else "cpu"


def exact_float32() -> None:
    """IEEE float32 products, and 16-bit ones accumulated in float32 (docs: "Architecture").

    TF32 off for float32 parity. cuBLAS may add up split-K partial sums of
    16-bit GEMMs in 16 bits unless told not to; the layer leaves these
    process-wide settings to its caller, and the parity runner and the
    benchmark ask for the products accumulated in float32 and rounded once.
    """
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def sync(value: Any) -> None:
    """Waits until ``value`` (a tensor, or anything else) is computed on its device."""
    if isinstance(value, torch.Tensor) and value.is_cuda:
        torch.cuda.synchronize()


# -- conversions -----------------------------------------------------------------


def to_native(x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> torch.Tensor:
    """``x`` as a tensor of ``dtype`` on ``device`` (a copy: ``x`` stays the caller's)."""
    return torch.from_numpy(np.array(x, copy=True)).to(_device(device), DTYPES[dtype])


def host_array(value: Any) -> Any:
    """A tensor as a numpy array on the host, in its own dtype; anything else as it is.

    numpy has no bfloat16: bfloat16 tensors come back as float32, which
    holds every bfloat16 value exactly.
    """
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        value = value.float()
    return value.numpy().copy()


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """A tensor of any dtype (bfloat16 included), on any device, as float64 numpy."""
    return np.asarray(host_array(x), dtype=np.float64)


def lens_to_native(valid_lens: Any, device: str = "cpu") -> Any:
    """Numeric numpy ``valid_lens`` as a tensor on ``device``, keeping their dtype.

    Anything else is returned as it is, for the layer's own checks to answer.
    """
    if isinstance(valid_lens, np.ndarray) and valid_lens.dtype.kind in "iuf":
        return torch.from_numpy(np.array(valid_lens, copy=True)).to(_device(device))
    return valid_lens


# -- the layer ---------------------------------------------------------------------


def make_layer(
    num_hiddens: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    **kwargs: Any,
) -> MultiHeadAttention:
    """The layer with its parameters on ``device`` in ``dtype``.

    Args:
        num_hiddens: the layer's ``num_hiddens``.
        num_heads: the layer's ``num_heads``.
        num_kv_heads: the layer's ``num_kv_heads`` (``None``: ``num_heads``).
        head_dim: the layer's ``head_dim`` (``None``: ``num_hiddens // num_heads``).
        device: ``"cpu"`` or ``"gpu"``.
        dtype: a key of :data:`DTYPES`.
        **kwargs: the layer's other arguments (``dropout``, ``bias``, sizes).
    """
    from mha_multi.torch.layer import MultiHeadAttention

    return MultiHeadAttention(
        num_hiddens,
        num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        device=_device(device),
        dtype=DTYPES[dtype],
        **kwargs,
    )


def init_cache(layer: MultiHeadAttention, batch_size: int, max_length: int) -> KVCache:
    """The layer's empty key/value cache, of its dtype and on its device."""
    return layer.init_cache(batch_size, max_length)


def forward(
    layer: MultiHeadAttention,
    queries: torch.Tensor,
    keys: torch.Tensor | None,
    values: torch.Tensor | None,
    valid_lens: Any,
    *,
    training: bool = False,
    head_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | tuple[Any, ...]:
    """One call of the layer in ``train()`` or ``eval()`` mode, without autograd.

    Args:
        layer: the layer.
        queries: ``(B, Q, query_size)``; keys, values likewise with ``K``
            (``None`` for a cached call that appends nothing).
        valid_lens: passed to the layer as it is.
        training: ``train()`` mode (dropout active) instead of ``eval()``.
        head_mask: the layer's ``head_mask``, passed as it is.
        **kwargs: the layer's ``causal``, ``return_attention_weights`` and
            ``cache``.
    """
    layer.train(training)
    with torch.no_grad():
        return layer(queries, keys, values, valid_lens, head_mask=head_mask, **kwargs)


def vjp(
    layer: MultiHeadAttention,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid_lens: Any,
    *,
    causal: bool,
    output_gradient: torch.Tensor,
    cache: KVCache | None = None,
    head_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The gradients of ``sum(output * output_gradient)`` of an ``eval()`` call.

    With a ``cache``, of the output of that cached call, the cache held
    fixed (it is detached); with a ``head_mask``, of the gated call.

    Returns:
        Tensors keyed ``queries``, ``keys``, ``values`` and the canonical
        weight names, kernels in the canonical ``(in, out)`` orientation;
        with a ``head_mask``, its gradient too, keyed ``head_mask``.
    """
    layer.eval()
    layer.zero_grad(set_to_none=True)
    inputs = [x.detach().requires_grad_(True) for x in (queries, keys, values)]
    gates = None if head_mask is None else head_mask.detach().requires_grad_(True)
    if cache is None:
        output = layer(*inputs, valid_lens, causal=causal, head_mask=gates)
    else:
        held = type(cache)(*(x.detach() for x in cache))
        output = layer(*inputs, valid_lens, causal=causal, cache=held, head_mask=gates)[0]
    output.backward(output_gradient)
    grads = {name: x.grad for name, x in zip(INPUT_NAMES, inputs, strict=True)}
    if gates is not None:
        grads["head_mask"] = gates.grad
    for name in KERNEL_NAMES:
        linear = getattr(layer, name)
        grads[name] = linear.weight.grad.T
        if linear.bias is not None:
            grads[f"b_{name[-1]}"] = linear.bias.grad
    return grads


def head_mask_gradient(
    layer: MultiHeadAttention,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid_lens: Any,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``dL/dξ`` at ``ξ = 1`` of one batch: the gradient a head's importance is made of.

    ``L = loss_fn(layer(queries, keys, values, valid_lens, head_mask=ξ))``
    with one gate per head (docs: "Heads"), in the layer's current mode
    (:func:`mha_multi.torch.head_importance` puts it in ``eval()``). The
    gradient is taken with ``torch.autograd.grad``: the parameters'
    ``.grad`` are left as they are.

    Returns:
        ``(num_heads,)``, float32 for a 16-bit layer (else the layer's
        dtype), on the layer's device; zeros where the loss does not depend
        on the output.

    Raises:
        TypeError: ``loss_fn`` did not return a tensor.
        ValueError: it returned more than one number.
    """
    parameter = layer.W_o.weight
    dtype = torch.promote_types(parameter.dtype, torch.float32)
    # The whole layer's heads, also when they are sharded (docs: "Sharding heads").
    num_heads = layer._canonical_heads().num_heads
    gates = torch.ones(num_heads, dtype=dtype, device=parameter.device, requires_grad=True)
    with torch.enable_grad():
        loss = loss_fn(layer(queries, keys, values, valid_lens, head_mask=gates))
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss_fn must return a scalar tensor; got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor; got shape {tuple(loss.shape)}")
        if not loss.requires_grad:
            return torch.zeros_like(gates, requires_grad=False)
        (grad,) = torch.autograd.grad(loss.reshape(()), gates, allow_unused=True)
    return torch.zeros_like(gates, requires_grad=False) if grad is None else grad


@contextlib.contextmanager
def kernel_spy() -> Iterator[list[KernelCall]]:
    """Records every call of ``scaled_dot_product_attention`` while active.

    Yields:
        A list that gets one :class:`~mha_multi.parity.runners.KernelCall`
        per call: whether a mask was passed, the kernel's causal flag and
        its dropout rate.
    """
    from mha_multi.parity.runners import KernelCall

    calls: list[KernelCall] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        given = {**dict(zip(_SDPA_PARAMETERS, args, strict=False)), **kwargs}
        calls.append(
            KernelCall(
                mask=given.get("attn_mask") is not None,
                is_causal=bool(given.get("is_causal", False)),
                dropout=float(given.get("dropout_p", 0.0)),
            )
        )
        return original(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = recording
    try:
        yield calls
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def native_layer(
    weights: Mapping[str, np.ndarray],
    num_heads: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
) -> torch.nn.MultiheadAttention:
    """``torch.nn.MultiheadAttention`` (``batch_first``, ``eval()``) holding canonical weights.

    It takes key padding as ``key_padding_mask``
    (:func:`mha_multi.interop.torch.key_padding_mask`).

    Args:
        weights: canonical weights; ``query_size`` must equal ``num_hiddens``.
        num_heads: number of heads.
        device: ``"cpu"`` or ``"gpu"``.
        dtype: a key of :data:`DTYPES`.
    """
    from mha_multi.interop.torch import to_torch_mha

    module = to_torch_mha(weights, num_heads, batch_first=True)
    return module.to(device=_device(device), dtype=DTYPES[dtype]).eval()
