"""MXNet's facts, once: dtypes, devices, precision settings, conversions, checks.

What the layer needs of MXNet sits here, below it (docs: "Architecture"):
how a device name maps to a context, which setting gives exact float32
products, how arrays leave for numpy, and :class:`MXNetFacts`, what the call
flow of :mod:`mha_multi.call` asks of MXNet: how inputs, lengths, caches
and gates are checked, what can be read on the host, and the fused route
(:mod:`mha_multi.mxnet._kernel`). This module imports no layer; the parity
harness builds and drives layers (docs: "Architecture").

MXNet 1.9's numpy interface has no bfloat16, so :data:`DTYPES` has none.

MXNet's precision setting is an environment variable, which must be in place
before MXNet is loaded: importing this module applies it, before it imports
MXNet, and the package imports this module first.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mha_multi import call, spec

__all__ = [
    *call.FACTS_MODULE_NAMES,
    "FACTS",
    "LENS_DTYPES",
    "MXNetFacts",
    "as_int32",
    "gates_dtype",
    "device",
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
from mxnet import gluon  # noqa: E402

from mha_multi.mxnet._cross import cross_attention  # noqa: E402
from mha_multi.mxnet._kernel import SEQUENCE_MASK, sequence_mask_attention  # noqa: E402
from mha_multi.mxnet._ops import MXNetOps, apart, copied_to, dtype_kind  # noqa: E402
from mha_multi.mxnet._plain import plain_attention  # noqa: E402

#: dtype name -> MXNet (numpy-interface) dtype; MXNet 1.9 has no bfloat16.
DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in ("float64", "float32", "float16")}
#: Dtypes of ``mxnet.numpy`` arrays that lengths may have (no unsigned
#: integers beyond uint8); lengths of other dtypes reach the layer as numpy.
LENS_DTYPES = ("float64", "float32", "float16", "int64", "int32", "int8", "uint8")


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


def containers_on_host(value: Any) -> Any:
    """A list or tuple holding MXNet arrays (at any depth) as a list of numpy arrays,
    which numpy stacks as it stacks PyTorch's, JAX's and Keras' arrays (MXNet's have no
    ``__array__``: numpy makes an array of objects of them); anything else as it is."""
    if type(value) is list or type(value) is tuple:
        return [containers_on_host(host_array(x)) for x in value]
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
        # (By its name: numpy 1.23's longlong is an int64 whose type MXNet's tables lack.)
        dtype = np.dtype(valid_lens.dtype.name)
        return mx.np.array(valid_lens.astype(dtype, copy=False), dtype=dtype, ctx=_device(device))
    return valid_lens


def gates_dtype(dtype: Any) -> np.dtype:
    """The dtype of a layer's head gates: its own, float32 for a 16-bit layer (whose
    context is gated in float32, :func:`mha_multi.spec.apply_head_mask`)."""
    return np.promote_types(np.dtype(dtype), np.float32)


def as_int32(array: mx.np.ndarray) -> mx.np.ndarray:
    """``array`` as int32 (itself where it is): the graphs' one integer type."""
    return array if np.dtype(array.dtype) == np.int32 else array.astype(np.int32)


# -- the call's facts ----------------------------------------------------------------

#: The adapter of imperative calls (``mxnet.ndarray``'s numpy operations).
OPS = MXNetOps(mx.nd)


def _not_mxnet_numpy(name: str, x: Any) -> TypeError:
    hint = " (use .as_np_ndarray())" if isinstance(x, mx.nd.NDArray) else ""
    return TypeError(f"{name} must be an mxnet.numpy.ndarray{hint}; got {type(x).__name__}")


def _leading(x: mx.np.ndarray, axis: int, start: int, stop: int) -> mx.np.ndarray:
    """``x[start:stop]`` along ``axis`` (0 to 2), one operation: indexing costs some 300
    Python calls (docs: "Results", calls per call), ``npx.slice`` some 45."""
    if not 0 <= start < stop <= x.shape[axis]:
        return x[(slice(None),) * axis + (slice(start, stop),)]  # npx.slice fails on an empty slice
    return mx.npx.slice(x, (None,) * axis + (start,), (None,) * axis + (stop,))


class _HostView:
    """A host array's memory for numpy's ``from_dlpack``: no copy (MXNet's
    ``to_dlpack_for_read`` waits for the writes queued before it)."""

    def __init__(self, array: mx.np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, stream: Any = None) -> Any:
        return mx.nd.to_dlpack_for_read(self._array)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # (DLPack's CPU)


def _beside(name: str, x: Any, like: mx.np.ndarray) -> mx.np.ndarray:
    """``x`` as it is, if it is an ``mxnet.numpy`` array on ``like``'s device."""
    if not isinstance(x, mx.np.ndarray):
        raise _not_mxnet_numpy(name, x)
    if x.ctx != like.ctx:
        raise ValueError(f"{name} is on {x.ctx} but queries on {like.ctx}")
    return x


class MXNetFacts(call.Facts):
    """What a call of the MXNet layer asks of MXNet (:class:`mha_multi.call.Facts`).

    The layer runs on concrete arrays, hybridized or not: a hybridized call
    is checked and planned here too, before its graph, where values and
    shapes can still be read (docs: "Architecture").
    """

    kernel = SEQUENCE_MASK
    # (span_bucket_of: the default, spec.SPAN_BUCKET, imperative calls' too. They compile
    # nothing, but the cache's positions they attend over are a copy, npx.slice along
    # them: at a new size at every step, glibc's allocator serves the larger ones from a
    # heap that does not shrink, and a generation's resident memory grows by many times
    # its cache; docs: "Generating with a cache".)
    attends_filled = True
    rows_of_one_table = True

    def ops(self, like: mx.np.ndarray) -> MXNetOps:
        return OPS

    def constants_key(self, like: Any) -> mx.Context | None:
        """The array's context: every call with positions runs on arrays (docs:
        "Positions and biases"), and a constant made for it lands there; ``None``
        for a symbol."""
        return like.ctx if isinstance(like, mx.np.ndarray) else None

    def first_rows(self, x: mx.np.ndarray, start: int, stop: int) -> mx.np.ndarray:
        return _leading(x, 0, start, stop)

    def rows_at(self, x: mx.np.ndarray, index: np.ndarray) -> mx.np.ndarray:
        # (One gather of whole rows, the index made where the table lies.)
        return mx.np.take(x, copied_to(x.ctx, index, np.int64), axis=0)

    def dtype_kind(self, dtype: Any) -> str:
        return dtype_kind(dtype)

    def check_input(
        self, name: str, x: Any, *, like: mx.np.ndarray | None, dtype: np.dtype | None
    ) -> mx.np.ndarray:
        """A floating ``mxnet.numpy`` array of the parameters' ``dtype``, on ``like``'s device.

        Raises:
            TypeError: a symbol (the masks need the dtype and rank MXNet 1.9
                symbols lack), not an ``mxnet.numpy`` array, not floating, or
                not of ``dtype``.
            ValueError: on another device than ``like``.
        """
        if isinstance(x, mx.sym.Symbol):
            raise TypeError(
                f"{name} is a Symbol: MultiHeadAttention runs on concrete arrays, because MXNet "
                "1.9 symbols have no dtype or rank and the masks depend on them; hybridize the "
                "layer itself instead of tracing it inside another block's hybrid_forward"
            )
        if not isinstance(x, mx.np.ndarray):
            raise _not_mxnet_numpy(name, x)
        found = np.dtype(x.dtype)
        if dtype_kind(found) != "f":
            raise TypeError(f"{name} must be a floating-point array; got {found}")
        if dtype is not None and found != dtype:
            raise TypeError(
                f"{name} dtype {found} differs from the layer's parameter dtype "
                f"{dtype}; convert one of them (e.g. layer.cast({found.name!r}))"
            )
        if like is not None and x.ctx != like.ctx:
            raise ValueError(f"{name} is on {x.ctx} but queries on {like.ctx}")
        return x

    def as_lens(self, valid_lens: Any, like: mx.np.ndarray) -> mx.np.ndarray | None:
        """``valid_lens`` as an ``mxnet.numpy`` array on ``like``'s device.

        MXNet arrays keep their dtype. Others become int32 where integer:
        MXNet has no unsigned integers beyond uint8, and any length past
        int32's range means what int32's bound means (key counts fit in it).
        """
        if valid_lens is None:
            return None
        if isinstance(valid_lens, mx.nd.NDArray):
            lens = valid_lens
            if not isinstance(lens, mx.np.ndarray):
                lens = lens.as_np_ndarray()
            spec.check_valid_lens_dtype(dtype_kind(lens.dtype))
            return lens.as_in_ctx(like.ctx)
        array = spec.lens_as_numpy(valid_lens, np.int32)
        return mx.np.array(array, dtype=array.dtype, ctx=like.ctx)

    def as_cache(self, cache: Any, like: mx.np.ndarray) -> spec.KVCache:
        """A ``KVCache`` of ``mxnet.numpy`` arrays on ``like``'s device.

        Its keys and values must have ``like``'s dtype: the queries have the
        parameters' dtype, checked.

        Raises:
            TypeError: not a triple of ``mxnet.numpy`` arrays, or keys or
                values of another dtype.
            ValueError: an array on another device.
        """
        cache = spec.as_kv_cache(cache)
        for name, array in zip(spec.KVCache._fields, cache, strict=True):
            if not isinstance(array, mx.np.ndarray):
                raise TypeError(
                    f"cache.{name} must be an mxnet.numpy.ndarray; got {type(array).__name__}"
                )
            if array.ctx != like.ctx:
                raise ValueError(f"cache.{name} is on {array.ctx} but queries on {like.ctx}")
        dtype = np.dtype(like.dtype)
        for name, array in (("keys", cache.keys), ("values", cache.values)):
            if np.dtype(array.dtype) != dtype:
                raise TypeError(
                    f"cache.{name} dtype {np.dtype(array.dtype)} differs from the layer's "
                    f"parameter dtype {dtype}; make the cache with layer.init_cache"
                )
        return cache

    def as_positions(self, positions: Any, like: mx.np.ndarray) -> mx.np.ndarray:
        """An ``mxnet.numpy`` array on the queries' device; numpy arrays and lists converted,
        and MXNet's legacy arrays, as :meth:`as_lens` takes them (segment ids too)."""
        if isinstance(positions, mx.nd.NDArray) and not isinstance(positions, mx.np.ndarray):
            positions = positions.as_np_ndarray()
        if not isinstance(positions, mx.np.ndarray):
            positions = spec.positions_on_host(positions)
            dtype = positions.dtype
            if dtype.kind in "iu" and dtype.type not in (np.int8, np.uint8, np.int32, np.int64):
                dtype = np.dtype(np.int64)  # (MXNet has no int16, uint16, uint32 or uint64 arrays)
            positions = mx.np.array(positions, dtype=dtype, ctx=like.ctx)
        return positions.as_in_ctx(like.ctx)

    def as_bias(self, bias: Any, like: mx.np.ndarray) -> mx.np.ndarray:
        """``bias`` as it is: an ``mxnet.numpy`` array on the queries' device."""
        return _beside("bias", bias, like)

    def as_gates(self, head_mask: Any, like: mx.np.ndarray) -> mx.np.ndarray:
        """``head_mask`` as it is: an ``mxnet.numpy`` array on the queries' device."""
        return _beside("head_mask", head_mask, like)

    def read(self, *arrays: mx.np.ndarray | None) -> list[np.ndarray | None]:
        """Always: hybridized calls are checked on concrete arrays before their graph."""
        return call.read_all(arrays, host_array)

    def write_cache(
        self,
        ops: MXNetOps,
        cache: spec.KVCache,
        k: Any,
        v: Any,
        valid_lens: Any,
        *,
        head_dim: int,
        causal: bool,
        fill: spec.CacheFill | None,
    ) -> tuple[spec.KVCache, Any]:
        """Each example's rows written into the cache's own arrays, by slice assignment.

        Only for a call given ``fill``: the layer passes it to calls that
        record no gradient (:func:`mha_multi.mxnet._graph.run`).
        The returned cache shares ``keys`` and ``values`` with the given
        one, with new int32 ``lengths``. Every other call gets the spec's
        functional update, and so does a cache whose keys and values are one
        array (or share memory): a row written into one would change the other.
        """
        if fill is None or k is None or k.shape[1] == 0 or not apart(cache.keys, cache.values):
            return super().write_cache(
                ops, cache, k, v, valid_lens, head_dim=head_dim, causal=causal, fill=fill
            )
        batch, num_new = k.shape[:2]
        first = fill.uniform_start(num_new)
        for held, x in ((cache.keys, k), (cache.values, v)):
            rows = x.reshape(batch, num_new, held.shape[1], head_dim).transpose(0, 2, 1, 3)
            if first is not None:
                held[:, :, first : first + num_new] = rows
                continue
            for b in np.flatnonzero(fill.new).tolist():
                start, count = int(fill.lengths[b]), int(fill.new[b])
                held[b, :, start : start + count] = rows[b, :, :count]
        ctx = k.ctx
        lengths = copied_to(ctx, fill.held, np.int32)
        visible = copied_to(ctx, fill.visibility(num_new, causal=causal), np.int32)
        return spec.KVCache(cache.keys, cache.values, lengths), visible

    def cache_prefix(self, keys: Any, values: Any, span: int, first: int = 0) -> tuple[Any, Any]:
        return _leading(keys, 2, first, span), _leading(values, 2, first, span)

    def finite_past(self, keys: Any, values: Any, span: int) -> bool:
        """Read: the values past ``span`` on the host.

        A host array is read where it lies (numpy's view of it through DLPack,
        once the writes queued before are done), every value tested: over the
        767 positions past 257 of an 8/8 cache of 1024 (8 examples, 64 per
        head) 1.1 ms, against 3.4 ms for the slice copied to numpy and summed
        there, and 5.4 ms for MXNet's own reduction over half the cache.
        Elsewhere the slice is copied and summed in float32 (finite only
        where every value is, or a large sum overflows)."""
        if values.ctx.device_type == "cpu":
            held = np.from_dlpack(_HostView(values))
            return bool(np.isfinite(held[:, :, span:]).all())
        rest = _leading(values, 2, span, values.shape[2]).asnumpy()
        return bool(np.isfinite(rest.sum(dtype=np.float32)))

    # Plain self- and cross-attention by their signature's plan, or ``None`` (the generic
    # flow): the plans' own functions, whose first argument is these facts
    # (:func:`mha_multi.mxnet._plain.plain_attention`,
    # :func:`mha_multi.mxnet._cross.cross_attention`).
    plain_attention = plain_attention
    cross_attention = cross_attention

    def fused_attention(self, ops: MXNetOps, *args: Any, **kwargs: Any) -> Any:
        """:func:`mha_multi.mxnet._kernel.sequence_mask_attention`, on arrays or in a graph."""
        return sequence_mask_attention(ops, *args, **kwargs)


#: The facts every MXNet layer's call is driven with.
FACTS = MXNetFacts()
