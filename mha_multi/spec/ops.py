"""The array-ops adapter the spec is written against, and numpy's (the float64 reference's).

Every function of the spec takes an adapter (``ops``) as its first argument:
a small object with the handful of array operations the math needs
(:class:`ArrayOps`). The operations are chosen so that no function needs a
concrete shape: head splitting is ``split_axis``/``merge_axes``, and sizes are
what ``ops.size`` returns (ints where shapes are known, an adapter's own
handle where they are not) and become positions only through ``ops.arange``.
This lets symbolic frameworks (MXNet's hybridized graphs) share the same code
as eager ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

Array = Any


def static_split_sizes(size: Any, sizes: tuple[int, int]) -> tuple[Any, Any]:
    """``sizes`` with a ``-1`` resolved from the size of the axis being split.

    Reshapes cannot infer ``-1`` for arrays with no elements (``B = 0`` or
    ``Q = 0``), so adapters whose shapes are known resolve it here; ``size``
    may be a Python int or a symbolic size (``torch.SymInt``, a scalar tensor).
    """
    first, second = sizes
    if first == -1:
        return size // second, second
    if second == -1:
        return first, size // first
    return first, second


class ArrayOps(Protocol):
    """The array operations the spec is written against.

    Implementations must not change dtypes except where asked (``cast``) and
    must follow numpy broadcasting.
    """

    def split_axis(self, x: Array, axis: int, sizes: tuple[int, int]) -> Array:
        """Splits ``axis`` into two axes of ``sizes`` (one of them may be -1)."""

    def merge_axes(self, x: Array, axis: int) -> Array:
        """Merges ``axis`` and ``axis + 1`` into one axis (row-major)."""

    def permute(self, x: Array, axes: Sequence[int]) -> Array: ...

    def expand_dims(self, x: Array, axis: int) -> Array: ...

    def matmul(self, a: Array, b: Array) -> Array:
        """Batched matrix product over the last two axes."""

    def swap_last(self, x: Array) -> Array:
        """Transposes the last two axes."""

    def matmul_swapped(self, a: Array, b: Array) -> Array:
        """``matmul(a, swap_last(b))``: the scores' product, which a framework may take
        without moving ``b`` (MXNet's ``batch_dot(..., transpose_b=True)``)."""

    def size(self, x: Array, axis: int) -> Any:
        """The size of ``axis`` of ``x``.

        A Python int where the shape is known; otherwise whatever the
        adapter's :meth:`arange` takes (a scalar tensor in a traced graph, a
        handle on a symbol whose shape MXNet does not know).
        """

    def arange(self, size: Any) -> Array:
        """``0 .. size - 1`` as a 1-D integer array on the adapter's device."""

    def flip(self, x: Array) -> Array:
        """Reverses a 1-D array."""

    def less(self, a: Array, b: Array) -> Array: ...

    def greater_equal(self, a: Array, b: Array) -> Array: ...

    def logical_and(self, a: Array, b: Array) -> Array: ...

    def where(self, condition: Array, x: Array, fill: float | Array) -> Array: ...

    def softmax(self, x: Array) -> Array:
        """Softmax over the last axis, as numpy's ``exp(x - max) / sum``.

        A row holding a NaN or ``+inf`` score, or only ``-inf`` scores, is all
        NaN (kernels that skip non-finite entries drift from the reference).
        Hidden keys' scores (:data:`~mha_multi.spec.MASK_VALUE`) have
        exponentials below the dtype's smallest normal number: a framework
        whose ``exp`` is slow there may floor the shifted scores first, which
        changes no weight by more than that number (PyTorch's CPU).
        """

    def cast(self, x: Array, dtype: Any) -> Array: ...

    def dtype(self, x: Array) -> Any: ...

    def dtype_kind(self, dtype: Any) -> str:
        """numpy's ``dtype.kind`` for a dtype of this framework ('f', 'i', ...)."""

    def itemsize(self, dtype: Any) -> int: ...

    def float32(self) -> Any: ...

    def ndim(self, x: Array) -> int: ...

    def float_bits(self, x: Array) -> Array | None:
        """The bits of floating ``x`` (float32 or float64) as signed integers of its
        width, where the framework's comparisons may take numbers below the dtype's
        smallest normal one as 0 (XLA's and TensorFlow's CPU kernels flush them to
        zero; PyTorch's where ``torch.set_flush_denormal`` says so); ``None`` where
        they compare them as they are."""

    # Used only by fused paths (:func:`fix_fully_hidden_rows`).

    def any_last(self, x: Array) -> Array:
        """Logical OR over the last axis, kept as an axis of size 1."""

    def logical_not(self, x: Array) -> Array: ...

    def mean(self, x: Array, axis: int) -> Array:
        """Mean over ``axis``, kept as an axis of size 1."""

    # Used only by cached calls (:func:`update_cache`).

    def gather_positions(self, x: Array, positions: Array) -> Array:
        """``x[b, positions[b, m]]``: rows of ``(B, T, F)`` picked by ``(B, M)`` ints."""

    # Used only by the options of docs "Positions and biases" (:func:`rotate`,
    # :func:`adjust_scores`); a layer without them never calls these.

    def slice_last(self, x: Array, start: int, stop: int) -> Array:
        """``x[..., start:stop]`` for static ints ``0 <= start <= stop <= size``."""

    def concat_last(self, xs: Sequence[Array]) -> Array:
        """The arrays joined along the last axis (same dtype, same leading shape)."""

    def cos(self, x: Array) -> Array: ...

    def sin(self, x: Array) -> Array: ...

    def tanh(self, x: Array) -> Array: ...

    def largest(self, x: Array) -> Array:
        """The largest entry of a non-empty array, as a 0-d array (a rotary length)."""

    def rsqrt(self, x: Array) -> Array:
        """``1 / sqrt(x)`` (the RMSNorm of ``qk_norm``, :func:`rms_norm`)."""

    def constant(self, value: np.ndarray, like: Array) -> Array:
        """A host numpy array as an array of this framework, beside ``like``.

        The dtype is ``value``'s (float32 or float64, chosen by the spec);
        the device is ``like``'s. Inverse frequencies and ALiBi slopes are
        computed once on the host in float64 (:meth:`Rotary.inverse_frequencies`,
        :func:`alibi_slopes`) and enter the arrays' computation through here.
        """


class NumpyDtypes:
    """The dtype methods of :class:`ArrayOps` for frameworks whose dtypes numpy reads.

    numpy's answers, for numpy, JAX and MXNet; a framework with a dtype
    numpy reads as another kind (JAX's bfloat16, kind ``'V'``) overrides
    ``dtype_kind``.
    """

    def dtype_kind(self, dtype: Any) -> str:
        return np.dtype(dtype).kind

    def itemsize(self, dtype: Any) -> int:
        return np.dtype(dtype).itemsize

    def float32(self) -> np.dtype:
        return np.dtype(np.float32)


class NamespaceOps:
    """The :class:`ArrayOps` methods that are one function of a numpy-like namespace.

    numpy, ``jax.numpy`` and ``torch`` give these functions the same names
    (the array API's), so an adapter that names its namespace (:attr:`xp`)
    has them written once, here. Keras' and MXNet's adapters keep their own:
    Keras casts where a backend's kernel is not exact, and MXNet's namespace
    is its graph's, given per call.
    """

    #: ``numpy``, ``jax.numpy`` or ``torch``.
    xp: Any

    def less(self, a: Array, b: Array) -> Array:
        return self.xp.less(a, b)

    def greater_equal(self, a: Array, b: Array) -> Array:
        return self.xp.greater_equal(a, b)

    def logical_and(self, a: Array, b: Array) -> Array:
        return self.xp.logical_and(a, b)

    def logical_not(self, x: Array) -> Array:
        return self.xp.logical_not(x)

    def slice_last(self, x: Array, start: int, stop: int) -> Array:
        return x[..., start:stop]

    def cos(self, x: Array) -> Array:
        return self.xp.cos(x)

    def sin(self, x: Array) -> Array:
        return self.xp.sin(x)

    def tanh(self, x: Array) -> Array:
        return self.xp.tanh(x)

    def largest(self, x: Array) -> Array:
        return self.xp.max(x)

    def float_bits(self, x: Array) -> Array | None:
        return None  # (numpy's comparisons take subnormal numbers as they are)


class NumpyOps(NumpyDtypes, NamespaceOps):
    """The spec on numpy; with float64 inputs this is the reference."""

    xp = np

    def split_axis(self, x: np.ndarray, axis: int, sizes: tuple[int, int]) -> np.ndarray:
        axis = axis % x.ndim
        sizes = static_split_sizes(x.shape[axis], sizes)
        return x.reshape(x.shape[:axis] + sizes + x.shape[axis + 1 :])

    def merge_axes(self, x: np.ndarray, axis: int) -> np.ndarray:
        axis = axis % x.ndim
        merged = x.shape[axis] * x.shape[axis + 1]
        return x.reshape((*x.shape[:axis], merged, *x.shape[axis + 2 :]))

    def permute(self, x: np.ndarray, axes: Sequence[int]) -> np.ndarray:
        return np.transpose(x, axes)

    def expand_dims(self, x: np.ndarray, axis: int) -> np.ndarray:
        x = np.asarray(x)
        # Indexing with None is np.expand_dims without its argument handling.
        return x[(slice(None),) * (axis % (x.ndim + 1)) + (None,)]

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.matmul(a, b)

    def swap_last(self, x: np.ndarray) -> np.ndarray:
        return np.swapaxes(x, -1, -2)

    def matmul_swapped(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.matmul(a, np.swapaxes(b, -1, -2))

    def size(self, x: np.ndarray, axis: int) -> int:
        return np.shape(x)[axis]

    def arange(self, size: int) -> np.ndarray:
        return np.arange(size, dtype=np.int64)

    def flip(self, x: np.ndarray) -> np.ndarray:
        return x[::-1]

    def where(self, condition: np.ndarray, x: np.ndarray, fill: Any) -> np.ndarray:
        return np.where(condition, x, np.asarray(fill, dtype=x.dtype))

    def softmax(self, x: np.ndarray) -> np.ndarray:
        if x.shape[-1] == 0:  # no keys: nothing to normalise (and max() has no identity)
            return x.copy()
        shifted = np.exp(x - x.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)

    def cast(self, x: np.ndarray, dtype: Any) -> np.ndarray:
        return np.asarray(x).astype(dtype, copy=False)

    def dtype(self, x: np.ndarray) -> np.dtype:
        return np.asarray(x).dtype

    def ndim(self, x: np.ndarray) -> int:
        return np.ndim(x)

    def any_last(self, x: np.ndarray) -> np.ndarray:
        return np.any(x, axis=-1, keepdims=True)

    def mean(self, x: np.ndarray, axis: int) -> np.ndarray:
        return np.mean(x, axis=axis, keepdims=True)

    def gather_positions(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return np.take_along_axis(x, positions[..., None], axis=1)

    def concat_last(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate(list(xs), axis=-1)

    def rsqrt(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / np.sqrt(x)

    def constant(self, value: np.ndarray, like: Any) -> np.ndarray:
        return np.asarray(value)
