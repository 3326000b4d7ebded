"""MXNet's facts, once: dtypes, devices, precision settings, conversions and calls.

The parity runners, the benchmark and the tests reach MXNet through this
module (docs: "Architecture"): how a device name maps to a context, which
setting gives exact float32 products, how arrays leave for numpy, how the
layer is built, called and differentiated, and how its fast route is
observed.

MXNet 1.9's numpy interface has no bfloat16, so :data:`DTYPES` has none.
MXNet has no attention layer of its own (Gluon's core has none), so there is
no ``native_layer`` here; the benchmark's baseline is d2l's MXNet layer
(:class:`mha_multi.bench.mxnet.D2LMultiHeadAttention`).

MXNet's precision setting is an environment variable, which must be in place
before MXNet is loaded: importing this module applies it, before it imports
MXNet, and the layer imports this module first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from mha_multi.weights import KERNEL_NAMES

if TYPE_CHECKING:
    from mha_multi.mxnet.layer import MultiHeadAttention
    from mha_multi.parity.runners import KernelCall
    from mha_multi.spec import KVCache

__all__ = [
    "DTYPES",
    "LENS_DTYPES",
    "device",
    "device_description",
    "exact_float32",
    "forward",
    "head_mask_gradient",
    "gpu_available",
    "host_array",
    "init_cache",
    "kernel_spy",
    "lens_to_native",
    "make_layer",
    "sync",
    "to_native",
    "to_numpy",
    "vjp",
]

#: Float32 products on GPUs stay IEEE float32: no implicit conversion to
#: tensor-core float16 math (docs: "Architecture"). This is MXNet's default,
#: pinned; MXNet reads it when it runs a product.
EXACT_FLOAT32_ENVIRONMENT = {"MXNET_CUDA_TENSOR_OP_MATH_ALLOW_CONVERSION": "0"}


def exact_float32() -> None:
    """IEEE float32 products on GPUs (docs: "Architecture").

    Sets :data:`EXACT_FLOAT32_ENVIRONMENT` where the environment does not
    say otherwise. This module does so when imported, before MXNet is, so
    calling it again (as the parity runner and the benchmark do) is a no-op.
    """
    for name, value in EXACT_FLOAT32_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


exact_float32()

import mxnet as mx  # noqa: E402  (after the environment it reads)
from mxnet import autograd, gluon  # noqa: E402

#: dtype name -> MXNet (numpy-interface) dtype; MXNet 1.9 has no bfloat16.
DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in ("float64", "float32", "float16")}
#: Dtypes of ``mxnet.numpy`` arrays that lengths may have (no unsigned
#: integers beyond uint8); lengths of other dtypes reach the layer as numpy.
LENS_DTYPES = ("float64", "float32", "float16", "int64", "int32", "int8", "uint8")

INPUT_NAMES = ("queries", "keys", "values")


# -- devices -----------------------------------------------------------------------


def device(name: str) -> mx.Context:
    """The MXNet context of a device name.

    Args:
        name: ``"cpu"`` or ``"gpu"`` (the first GPU).
    """
    return mx.gpu(0) if name == "gpu" else mx.cpu()


# Parameters named ``device`` shadow the function above inside the functions below.
_device = device


def gpu_available() -> bool:
    """Whether MXNet sees a GPU."""
    return mx.context.num_gpus() > 0


def device_description(name: str) -> str:
    """The device as reports name it: ``"cpu"``, or the GPU's context and how many there are."""
    if name != "gpu":
        return "cpu"
    return f"{device(name)} of {mx.context.num_gpus()}"


def sync(value: Any = None) -> None:
    """Waits until everything MXNet was asked to compute (``value`` included) is done."""
    mx.npx.waitall()


# -- conversions -----------------------------------------------------------------


def to_native(x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> mx.np.ndarray:
    """``x`` as an ``mxnet.numpy`` array of ``dtype`` on ``device``."""
    return mx.np.array(np.asarray(x, dtype=dtype), dtype=dtype, ctx=_device(device))


def host_array(value: Any) -> Any:
    """An MXNet array (or a Gluon parameter's data) as numpy, in its own dtype.

    Anything else is returned as it is.
    """
    if isinstance(value, gluon.Parameter):
        value = value.data()
    if isinstance(value, mx.nd.NDArray):
        return value.asnumpy()
    return value


def to_numpy(x: Any) -> np.ndarray:
    """An MXNet array, on any device, as float64 numpy."""
    return np.asarray(host_array(x), dtype=np.float64)


def lens_to_native(valid_lens: Any, device: str = "cpu") -> Any:
    """Numeric numpy ``valid_lens`` as an ``mxnet.numpy`` array on ``device``, same dtype.

    Lengths of a dtype MXNet has no arrays of are returned as numpy, as a
    user must pass them, and so is anything else, for the layer's own checks
    to answer.
    """
    if (
        isinstance(valid_lens, np.ndarray)
        and valid_lens.dtype.kind in "iuf"
        and valid_lens.dtype.name in LENS_DTYPES
    ):
        return mx.np.array(valid_lens, dtype=valid_lens.dtype, ctx=_device(device))
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
    hybridize: bool = False,
    **kwargs: Any,
) -> MultiHeadAttention:
    """The layer, initialized to zeros on ``device`` in ``dtype``.

    Zeros: every use loads weights next; the parameters (or their deferred
    initialization) are placed on the device now.

    Args:
        num_hiddens: the layer's ``num_hiddens``.
        num_heads: the layer's ``num_heads``.
        num_kv_heads: the layer's ``num_kv_heads`` (``None``: ``num_heads``).
        head_dim: the layer's ``head_dim`` (``None``: ``num_hiddens // num_heads``).
        device: ``"cpu"`` or ``"gpu"``.
        dtype: a key of :data:`DTYPES`.
        hybridize: hybridize it (one cached graph per call configuration).
        **kwargs: the layer's other arguments (``dropout``, ``bias``, sizes).
    """
    from mha_multi.mxnet.layer import MultiHeadAttention

    layer = MultiHeadAttention(
        num_hiddens, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, **kwargs
    )
    layer.initialize(mx.init.Zero(), ctx=_device(device))
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
) -> dict[str, mx.np.ndarray]:
    """The gradients of ``sum(output * output_gradient)`` of a call out of training mode.

    With a ``cache``, of that cached call's output, the cache held fixed
    (its arrays get no gradient). ``keys``/``values`` may then be ``None``,
    and have no gradient. With a ``head_mask``, of the gated call, and the
    gates' gradient too.

    Returns:
        Arrays keyed ``queries``, ``keys``, ``values`` and the canonical
        weight names, kernels in the canonical ``(in, out)`` orientation;
        and ``head_mask`` (of the gates' shape and dtype) with a ``head_mask``.
    """
    given = (queries, keys, values, head_mask)
    inputs = {
        name: x.copy()
        for name, x in zip((*INPUT_NAMES, "head_mask"), given, strict=True)
        if x is not None
    }
    for array in inputs.values():
        array.attach_grad()
    options = {} if cache is None else {"cache": cache}
    if head_mask is not None:
        options["head_mask"] = inputs["head_mask"]
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
    return grads


def head_mask_gradient(
    layer: MultiHeadAttention,
    queries: mx.np.ndarray,
    keys: mx.np.ndarray,
    values: mx.np.ndarray,
    valid_lens: Any,
    loss_fn: Callable[[mx.np.ndarray], mx.np.ndarray],
) -> np.ndarray:
    """``dL/dξ`` at gates ``ξ`` of ones ``(num_heads,)``, ``L = loss_fn(output)`` (eval mode).

    One batch of :func:`mha_multi.mxnet.head_importance` (docs: "Heads").
    Only the gates' gradient is taken (``autograd.grad``): the layer's
    parameters and the inputs keep the gradients they hold.

    Returns:
        The gradient as float64 numpy ``(num_heads,)``.

    Raises:
        TypeError: ``loss_fn`` did not return an ``mxnet.numpy`` array of one element.
    """
    gates = mx.np.ones((layer.num_heads,), dtype=layer.dtype, ctx=queries.ctx)
    gates.attach_grad()
    with autograd.record(train_mode=False):
        loss = loss_fn(layer(queries, keys, values, valid_lens, head_mask=gates))
        if not isinstance(loss, mx.np.ndarray) or loss.size != 1:
            raise TypeError(
                "loss_fn must return a scalar mxnet.numpy array; got "
                f"{type(loss).__name__}{getattr(loss, 'shape', '')}"
            )
    (gradient,) = autograd.grad(loss, [gates], train_mode=False)
    return to_numpy(gradient)


def init_cache(layer: MultiHeadAttention, batch_size: int, max_length: int) -> KVCache:
    """The layer's empty cache (``layer.init_cache``), of its dtype and on its device."""
    return layer.init_cache(batch_size, max_length)


@contextlib.contextmanager
def kernel_spy() -> Iterator[list[KernelCall]]:
    """Records every run of the layer's fast route while active.

    The fast route's kernel is ``npx.sequence_mask``; a route whose mask
    hides nothing runs without it. A hybridized layer runs the route while
    it traces a configuration's graph (its first call), an imperative one on
    every call.

    Yields:
        A list that gets one :class:`~mha_multi.parity.runners.KernelCall`
        per run: ``mask`` whether it called ``sequence_mask``, no causal flag
        (the rule is in the mask), and the dropout rate it gave
        ``npx.dropout``.
    """
    from mha_multi.mxnet.layer import _AttentionGraph
    from mha_multi.parity.runners import KernelCall

    calls: list[KernelCall] = []
    running: list[bool] = []  # non-empty while a fast route runs

    def route(original: Callable[..., Any]) -> Callable[..., Any]:
        def recording(graph: _AttentionGraph, *args: Any, **kwargs: Any) -> Any:
            calls.append(KernelCall(mask=False, is_causal=False))
            running.append(True)
            try:
                return original(graph, *args, **kwargs)
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

    patches = [(_AttentionGraph, "_fused_attention", route)]
    for module in (mx.ndarray.numpy_extension, mx.symbol.numpy_extension):
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
