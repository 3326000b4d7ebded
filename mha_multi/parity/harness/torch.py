"""What drives the PyTorch layer: building it, calls, gradients, the kernel spy, the native one.

The parity runner, the benchmark and the tests reach PyTorch through this
module (docs: "Architecture"). It sits above the layer: it imports the layer
and :mod:`mha_multi.torch._facts` (PyTorch's facts, whose public names are
read through this module too: ``harness.to_numpy``), and nothing in
:mod:`mha_multi.torch` imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any
from unittest import mock

import numpy as np
import torch

from mha_multi import _docs
from mha_multi.interop.torch import to_torch_mha
from mha_multi.parity.harness import KernelCall, facts_passthrough
from mha_multi.spec import SPAN_BUCKET, KVCache
from mha_multi.torch import _facts
from mha_multi.torch._facts import DTYPES
from mha_multi.torch.importance import head_mask_gradient
from mha_multi.torch.layer import MultiHeadAttention
from mha_multi.weights import KERNEL_NAMES, NORM_NAMES, SINKS_NAME

__all__ = [
    "as_if_on_a_gpu",
    "forward",
    "generic_flow_only",
    "head_mask_gradient",
    "init_cache",
    "kernel_spy",
    "make_layer",
    "native_layer",
    "vjp",
]

__getattr__ = facts_passthrough(__name__, _facts)

INPUT_NAMES = ("queries", "keys", "values")
#: ``scaled_dot_product_attention``'s leading positional parameters.
_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


# -- the layer ---------------------------------------------------------------------


@_docs.fill
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
        {harness_layer_args}
        dtype: a key of :data:`DTYPES`.
        **kwargs: the layer's other arguments (``dropout``, ``bias``, sizes).
    """
    return MultiHeadAttention(
        num_hiddens,
        num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        device=_facts.device(device),
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
    positions: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The gradients of ``sum(output * output_gradient)`` of an ``eval()`` call.

    With a ``cache``, of the output of that cached call, the cache held
    fixed (it is detached); with a ``head_mask`` or a ``bias``, of that call.

    Returns:
        Tensors keyed ``queries``, ``keys``, ``values`` and the canonical
        weight names, kernels in the canonical ``(in, out)`` orientation;
        with a ``head_mask`` or a ``bias``, its gradient too, keyed by its name.
    """
    layer.eval()
    layer.zero_grad(set_to_none=True)
    inputs = [x.detach().requires_grad_(True) for x in (queries, keys, values)]
    given = {"head_mask": head_mask, "bias": bias}
    leaves = {n: x.detach().requires_grad_(True) for n, x in given.items() if x is not None}
    options = {**leaves, "positions": positions, "causal": causal}
    if segment_ids is not None:
        options["segment_ids"] = segment_ids
    if cache is None:
        output = layer(*inputs, valid_lens, **options)
    else:
        held = type(cache)(*(x.detach() for x in cache))
        output = layer(*inputs, valid_lens, cache=held, **options)[0]
    output.backward(output_gradient)
    grads = {name: x.grad for name, x in zip(INPUT_NAMES, inputs, strict=True)}
    grads.update({name: x.grad for name, x in leaves.items()})
    for name in KERNEL_NAMES:
        linear = getattr(layer, name)
        grads[name] = linear.weight.grad.T
        if linear.bias is not None:
            grads[f"b_{name[-1]}"] = linear.bias.grad
    grads.update({name: layer.get_parameter(name).grad for name in _norms(layer)})
    if layer.options.sinks:
        grads[SINKS_NAME] = layer.sinks.grad
    return grads


def _norms(layer: MultiHeadAttention) -> tuple[str, ...]:
    """The names of the layer's query/key norm weights (none without ``qk_norm``)."""
    return () if layer.options.qk_norm is None else NORM_NAMES


@contextlib.contextmanager
def kernel_spy() -> Iterator[list[KernelCall]]:
    """Records every call of ``scaled_dot_product_attention`` while active.

    Yields:
        A list that gets one :class:`~mha_multi.parity.harness.KernelCall`
        per call: whether a mask was passed, the kernel's causal flag and
        its dropout rate.
    """
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


@contextlib.contextmanager
def generic_flow_only() -> Iterator[None]:
    """PyTorch's fast route answering no call while active: every call takes the
    generic flow (docs: "Fast paths").

    The route's three offers, a call without a cache (``plain_attention``), a
    decoding step at the layer's door (``plain_step``) and cross-attention
    (``cross_attention``), each answered ``None`` by one plain function, as
    the route's own first test answers: a count of the Python calls a call
    makes counts the offers the route takes.
    """
    facts = _facts.FACTS

    def declined(*_: Any, **__: Any) -> None:
        return None

    with (
        mock.patch.object(facts, "plain_attention", declined),
        mock.patch.object(facts, "plain_step", declined),
        mock.patch.object(facts, "cross_attention", declined),
    ):
        yield


@contextlib.contextmanager
def as_if_on_a_gpu() -> Iterator[None]:
    """PyTorch's facts told that every tensor is on a GPU, while active.

    Nothing is on the host, so an eager call reads no value below
    :data:`mha_multi.spec.DEVICE_READ_SCORES` scores per head (or, recording
    no gradient, :data:`mha_multi.spec.DEVICE_READ_TOTAL_SCORES` in all), and a cache's span is
    rounded up to :data:`mha_multi.spec.SPAN_BUCKET`, as for CUDA tensors:
    on the CPU, a call runs the operations it would run on a GPU (the tests
    of what waits for a GPU, and the host time of a GPU's decoding step,
    measured on the CPU).
    """
    facts = _facts.FACTS
    with (
        mock.patch.object(facts, "on_host", lambda q: False),
        mock.patch.object(facts, "span_bucket_of", lambda keys: SPAN_BUCKET),
    ):
        yield


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
    module = to_torch_mha(weights, num_heads, batch_first=True)
    return module.to(device=_facts.device(device), dtype=DTYPES[dtype]).eval()
