"""What drives the MXNet layer: building it, calls, gradients, the fast route's spy.

The parity runners, the benchmark and the tests reach MXNet through this
module (docs: "Architecture"). It sits above the layer: it imports the layer
and :mod:`mha_multi.mxnet._facts` (MXNet's facts, whose public names are
read through this module too: ``harness.to_numpy``), and nothing in
:mod:`mha_multi.mxnet` imports it.

MXNet has no attention layer of its own (Gluon's core has none), so there is
no ``native_layer`` here; the benchmark's baseline is d2l's MXNet layer
(:class:`mha_multi.bench.mxnet.D2LMultiHeadAttention`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

# First: MXNet's exact-float32 environment is in place before MXNet loads
# (docs: "Architecture").
from mha_multi.mxnet import _facts  # isort: split

import mxnet as mx
from mxnet import autograd

from mha_multi import _docs
from mha_multi.call import INPUT_NAMES
from mha_multi.mxnet import _plain
from mha_multi.mxnet._facts import MXNetFacts
from mha_multi.mxnet.importance import head_mask_gradient
from mha_multi.mxnet.layer import MultiHeadAttention
from mha_multi.parity.harness import KernelCall, facts_passthrough
from mha_multi.spec import KVCache
from mha_multi.weights import KERNEL_NAMES, NORM_NAMES, SINKS_NAME

__all__ = [
    "forward",
    "head_mask_gradient",
    "init_cache",
    "kernel_spy",
    "make_layer",
    "vjp",
]

__getattr__ = facts_passthrough(__name__, _facts)


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
    hybridize: bool = False,
    **kwargs: Any,
) -> MultiHeadAttention:
    """The layer, initialized to zeros on ``device`` in ``dtype``.

    Zeros: every use loads weights next; the parameters (or their deferred
    initialization) are placed on the device now.

    Args:
        {harness_layer_args}
        dtype: a key of :data:`DTYPES`.
        hybridize: hybridize it (one cached graph per call configuration).
        **kwargs: the layer's other arguments (``dropout``, ``bias``, sizes).
    """
    layer = MultiHeadAttention(
        num_hiddens, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, **kwargs
    )
    layer.initialize(mx.init.Zero(), ctx=_facts.device(device))
    if hybridize:
        layer.hybridize()
    return layer


def forward(
    layer: MultiHeadAttention,
    queries: mx.np.ndarray,
    keys: mx.np.ndarray,
    values: mx.np.ndarray,
    valid_lens: Any,
    *,
    training: bool = False,
    **kwargs: Any,
) -> Any:
    """One call of the layer, in training mode (dropout active) or not.

    Args:
        layer: the layer.
        queries: ``(B, Q, query_size)``; keys, values likewise with ``K``.
        valid_lens: passed to the layer as it is.
        training: record in training mode, so that dropout acts.
        **kwargs: the layer's ``causal``, ``return_attention_weights``,
            ``cache`` (``keys``/``values`` ``None`` with a cache: attend to it
            as it is) and ``head_mask``.
    """
    if not training:
        return layer(queries, keys, values, valid_lens, **kwargs)
    with autograd.record(train_mode=True):
        return layer(queries, keys, values, valid_lens, **kwargs)


def vjp(
    layer: MultiHeadAttention,
    queries: mx.np.ndarray,
    keys: mx.np.ndarray | None,
    values: mx.np.ndarray | None,
    valid_lens: Any,
    *,
    causal: bool,
    output_gradient: mx.np.ndarray,
    cache: KVCache | None = None,
    head_mask: mx.np.ndarray | None = None,
    positions: Any = None,
    bias: mx.np.ndarray | None = None,
    segment_ids: Any = None,
) -> dict[str, mx.np.ndarray]:
    """The gradients of ``sum(output * output_gradient)`` of a call out of training mode.

    With a ``cache``, of that cached call's output, the cache held fixed
    (its arrays get no gradient). ``keys``/``values`` may then be ``None``,
    and have no gradient. With a ``head_mask`` or a ``bias``, of the call
    given it, and its gradient too; ``positions`` are passed on.

    Returns:
        Arrays keyed ``queries``, ``keys``, ``values`` and the canonical
        weight names, kernels in the canonical ``(in, out)`` orientation;
        and ``head_mask``, ``bias`` (of their shape and dtype) where given.
    """
    given = (queries, keys, values, head_mask, bias)
    inputs = {
        name: x.copy()
        for name, x in zip((*INPUT_NAMES, "head_mask", "bias"), given, strict=True)
        if x is not None
    }
    for array in inputs.values():
        array.attach_grad()
    options = {} if cache is None else {"cache": cache}
    options.update({name: inputs[name] for name in ("head_mask", "bias") if name in inputs})
    for name, ids in (("positions", positions), ("segment_ids", segment_ids)):
        if ids is not None:
            options[name] = ids
    with autograd.record(train_mode=False):
        result = layer(
            *(inputs.get(name) for name in INPUT_NAMES), valid_lens, causal=causal, **options
        )
    output = result if cache is None else result[0]
    output.backward(output_gradient)
    grads = {name: x.grad for name, x in inputs.items()}
    ctx = queries.ctx
    for name in KERNEL_NAMES:
        dense = getattr(layer, name)
        grads[name] = dense.weight.grad(ctx).T
        if dense.bias is not None:
            grads[f"b_{name[-1]}"] = dense.bias.grad(ctx)
    if layer.options.qk_norm is not None:
        grads.update({name: getattr(layer, name).grad(ctx) for name in NORM_NAMES})
    if layer.sinks is not None:
        grads[SINKS_NAME] = layer.sinks.grad(ctx)
    return grads


def init_cache(layer: MultiHeadAttention, batch_size: int, max_length: int) -> KVCache:
    """The layer's empty cache (``layer.init_cache``), of its dtype and on its device."""
    return layer.init_cache(batch_size, max_length)


@contextlib.contextmanager
def kernel_spy() -> Iterator[list[KernelCall]]:
    """Records every run of the layer's fast route while active.

    The fast route's kernel is ``npx.sequence_mask``; a route whose mask
    hides nothing runs without it. A hybridized layer runs the route while
    it traces a configuration's graph (its first call), an imperative one on
    every call, the plain calls' by their plans
    (:mod:`mha_multi.mxnet._plain`, :mod:`mha_multi.mxnet._cross`).

    Yields:
        A list that gets one :class:`~mha_multi.parity.harness.KernelCall`
        per run: ``mask`` whether it called ``sequence_mask``, no causal flag
        (the rule is in the mask), and the dropout rate it gave
        ``npx.dropout``.
    """
    calls: list[KernelCall] = []
    running: list[bool] = []  # non-empty while a fast route runs

    def route(original: Callable[..., Any]) -> Callable[..., Any]:
        def recording(*args: Any, **kwargs: Any) -> Any:
            calls.append(KernelCall(mask=False, is_causal=False))
            running.append(True)
            try:
                return original(*args, **kwargs)
            finally:
                running.pop()

        return recording

    def noting(note: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[..., Any]:
        """Wraps a kernel so that it writes ``note(kwargs)`` into the running route's record."""

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            def recording(*args: Any, **kwargs: Any) -> Any:
                if running:
                    calls[-1] = calls[-1]._replace(**note(kwargs))
                return original(*args, **kwargs)

            return recording

        return wrap

    # The generic flow's kernel, and the same attention as the plans of plain calls run it.
    patches = [(MXNetFacts, "fused_attention", route), (_plain, "_context", route)]
    # (mx.npx, which the plans call, holds the operators as its own names.)
    for module in (mx.ndarray.numpy_extension, mx.symbol.numpy_extension, mx.npx):
        patches.append((module, "sequence_mask", noting(lambda kwargs: {"mask": True})))
        # 0.5: MXNet's default rate.
        patches.append(
            (module, "dropout", noting(lambda kwargs: {"dropout": kwargs.get("p", 0.5)}))
        )
    with contextlib.ExitStack() as stack:
        for owner, name, wrap in patches:
            stack.enter_context(_patched(owner, name, wrap))
        yield calls


@contextlib.contextmanager
def _patched(owner: Any, name: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """``owner.name`` replaced by ``wrap(owner.name)`` while active."""
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)
