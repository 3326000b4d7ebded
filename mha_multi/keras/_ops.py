"""The spec's array-ops adapter on ``keras.ops``.

Written against ``keras.ops`` only, so the same adapter serves Keras'
TensorFlow, JAX and PyTorch backends; where one of them has a faster way to
Keras' own numbers (a reshape, a transpose, a product), the functions below
take it from :mod:`mha_multi.keras._frameworks`. Shapes are read with
``keras.ops.shape``, which gives Python ints where a dimension is static and
scalar tensors where it is not (TensorFlow graphs with an unknown batch), so
the reshapes below work in eager code, in ``tf.function``/XLA and in the
functional API alike.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from mha_multi import spec
from mha_multi.keras._framework_ops import framework_ops

Tensor = Any


# -- dtypes, by Keras' names -----------------------------------------------------------

#: Keras' name of each dtype object met so far: ``keras.backend.standardize_dtype``
#: costs 6 to 25 Python calls, and a call asks for a few dtypes dozens of times.
_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """Keras' name of ``dtype`` (``"float32"``...), as ``keras.backend.standardize_dtype``."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):  # (new, or a dtype that cannot be hashed)
        name = keras.backend.standardize_dtype(dtype)
    if framework_ops().memos_writable():
        with contextlib.suppress(TypeError):
            _NAMES[dtype] = name
    return name


_KINDS = (("bfloat", "f"), ("float", "f"), ("uint", "u"), ("int", "i"), ("bool", "b"))


#: :func:`dtype_kind` by dtype name, as each is met.
_KIND_OF: dict[str, str] = {}


def _kind_of(name: str) -> str:
    for prefix, kind in _KINDS:
        if name.startswith(prefix):
            return kind
    return "c" if name.startswith("complex") else "O"


def dtype_kind(dtype: Any) -> str:
    """numpy's ``dtype.kind`` letter for a Keras dtype (``'O'`` for strings and the like)."""
    name = dtype_name(dtype)
    try:
        return _KIND_OF[name]
    except KeyError:
        kind = _kind_of(name)
        if framework_ops().memos_writable():
            _KIND_OF[name] = kind
        return kind


def _itemsize(dtype: Any) -> int:
    name = dtype_name(dtype)
    if name == "bool":
        return 1
    bits = re.search(r"\d+", name)
    if bits is None:
        raise TypeError(f"dtype {name!r} has no fixed item size")
    return int(bits.group()) // 8


#: The 16-bit floats, by Keras' names.
_16_BIT = frozenset({"float16", "bfloat16"})


def is_16_bit(dtype: Any) -> bool:
    """Whether ``dtype`` is a 16-bit float (``float16``, ``bfloat16``)."""
    return dtype_name(dtype) in _16_BIT


def matmul_16_bit(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b (+ bias)`` of 16-bit operands, accumulated in float32 and rounded once.

    ``keras.ops.matmul`` cannot ask for a float32 accumulator, and the
    kernels underneath do not all use one: TensorFlow's bfloat16 matmul on
    x86 CPUs without AVX-512 BF16 is measured at twice the error of one
    rounding, XLA:CPU's float16 dot and PyTorch's CPU float16 bmm are not
    rounded once either. The products of two 16-bit numbers are exact in
    float32, so computing in float32 and rounding once is the spec's
    product on every machine; the gradients of this cast-compute-cast are
    accumulated in float32 alike.

    Args:
        a: left operand ``(..., n, k)``, 16-bit.
        b: right operand ``(..., k, m)``, 16-bit.
        bias: added to the float32 product before the rounding (``(m,)``).

    Returns:
        The product in ``a``'s dtype.
    """
    dtype = a.dtype
    product = ops.matmul(ops.cast(a, "float32"), ops.cast(b, "float32"))
    if bias is not None:
        product = ops.add(product, ops.cast(bias, "float32"))
    return ops.cast(product, dtype)


def _shape(x: Tensor) -> list[Any]:
    """``keras.ops.shape(x)`` as a list, read from ``x.shape`` where every size is static.

    The same sizes: ``keras.ops.shape`` asks the backend for the dynamic shape
    (an operation on TensorFlow) only to fill in the sizes ``x.shape`` lacks.
    """
    shape = list(framework_ops().shape(x))
    for size in shape:  # (a loop, not all(): every layout operation asks)
        if not isinstance(size, int):
            return list(ops.shape(x))
    return shape


#: Keras' TensorFlow backend computes a ``(..., n, k) @ (k, m)`` product with
#: ``tf.tensordot``, which reshapes to one 2-D ``tf.matmul`` through a dozen
#: Python-level operations per call; :meth:`KerasOps.matmul` makes the same
#: 2-D product itself there (the same numbers).
_FLATTENS_TENSORDOT = keras.backend.backend() == "tensorflow"


def index_dtype() -> str:
    """The integer dtype an int64 numpy array becomes on the active backend.

    ``int32`` on JAX without ``jax_enable_x64`` (read at every call: the flag
    may change while the process runs), ``int64`` elsewhere.
    """
    return keras.backend.standardize_dtype(ops.convert_to_tensor(np.zeros(0, np.int64)).dtype)


def check_held_dtype(name: str, dtype: str) -> None:
    """Refuses float64 where the active backend holds it as float32 (Keras on JAX
    without ``jax_enable_x64``, with JAX's warning alone): a layer or cache asked
    for it would compute in float32.

    Raises:
        ValueError: ``name`` is such a dtype.
    """
    if dtype != "float64":
        return
    held = keras.backend.standardize_dtype(ops.convert_to_tensor(np.zeros(0, dtype)).dtype)
    if held != dtype:
        raise ValueError(
            f"{name} {dtype}: Keras' {keras.backend.backend()} backend holds {dtype} arrays "
            f"as {held} without x64: jax.config.update('jax_enable_x64', True) keeps them"
        )


def check_held_policy(policy: Any) -> None:
    """:func:`check_held_dtype` of a layer's dtype policy: its variables' and its
    computation's dtypes (the library's layer and the native ones its converters make)."""
    check_held_dtype("dtype", policy.variable_dtype)
    check_held_dtype("dtype", policy.compute_dtype)


class KerasOps:
    """:class:`mha_multi.spec.ArrayOps` on ``keras.ops`` (any Keras backend).

    Operations go through :attr:`native`, the backend's own where
    ``keras.ops`` is pure overhead (:mod:`mha_multi.keras._framework_ops`).
    """

    #: The active backend's operations, made on first use (not at import).
    native: Any

    def __getattr__(self, name: str) -> Any:
        # Only for what the instance lacks: ``native`` on first use, an attribute from
        # then on. (Not functools.cached_property, whose lock before Python 3.12 stops
        # torch.compile's tracing of a first call.)
        if name != "native":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.native = framework_ops()
        return self.native

    def float_bits(self, x: Tensor) -> Tensor:
        wide = keras.backend.standardize_dtype(x.dtype) == "float64"
        return ops.view(x, "int64" if wide else "int32")

    def split_axis(self, x: Tensor, axis: int, sizes: tuple[int, int]) -> Tensor:
        shape = _shape(x)
        axis %= len(shape)
        sizes = spec.static_split_sizes(shape[axis], sizes)
        return self.native.reshape(x, (*shape[:axis], *sizes, *shape[axis + 1 :]))

    def merge_axes(self, x: Tensor, axis: int) -> Tensor:
        shape = _shape(x)
        axis %= len(shape)
        # No -1: a reshape cannot infer it when another axis is empty (B = 0,
        # Q = 0). Unknown sizes are scalar tensors, whose product is one too.
        merged = shape[axis] * shape[axis + 1]
        return self.native.reshape(x, (*shape[:axis], merged, *shape[axis + 2 :]))

    def permute(self, x: Tensor, axes: Sequence[int]) -> Tensor:
        return self.native.transpose(x, tuple(axes))

    def expand_dims(self, x: Tensor, axis: int) -> Tensor:
        return self.native.expand_dims(x, axis)

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        if self.dtype(a) == "float64" and self.dtype(b) == "float64":
            # Keras' promotion maps 64-bit types to 32-bit on its JAX and
            # PyTorch backends, and ops.matmul on PyTorch casts its result to
            # that type; ops.einsum keeps float64.
            return ops.einsum("...ij,...jk->...ik", a, b)
        if is_16_bit(a.dtype) and is_16_bit(b.dtype):
            return matmul_16_bit(a, b)
        if _FLATTENS_TENSORDOT and len(b.shape) == 2 and len(a.shape) > 2:
            shape = _shape(a)
            if all(isinstance(size, int) for size in shape) and a.dtype == b.dtype:
                # tf.tensordot's own reshapes, around the same tf.matmul.
                native = self.native
                flat = native.reshape(a, (math.prod(shape[:-1]), shape[-1]))
                return native.reshape(native.matmul(flat, b), (*shape[:-1], b.shape[1]))
        return self.native.matmul(a, b)

    def swap_last(self, x: Tensor) -> Tensor:
        rank = len(x.shape)
        return self.native.transpose(x, (*range(rank - 2), rank - 1, rank - 2))

    def matmul_swapped(self, a: Tensor, b: Tensor) -> Tensor:
        return self.matmul(a, self.swap_last(b))

    def size(self, x: Tensor, axis: int) -> Any:
        # An int, or a scalar tensor where a traced graph does not know it.
        return ops.shape(x)[axis]

    def arange(self, size: Any) -> Tensor:
        return self.native.arange(size)

    def flip(self, x: Tensor) -> Tensor:
        return ops.flip(x, axis=0)

    def less(self, a: Tensor, b: Tensor) -> Tensor:
        return self.native.compare("less", a, b)

    def greater_equal(self, a: Tensor, b: Tensor) -> Tensor:
        return self.native.compare("greater_equal", a, b)

    def logical_and(self, a: Tensor, b: Tensor) -> Tensor:
        return self.native.compare("logical_and", a, b)

    def where(self, condition: Tensor, x: Tensor, fill: float | Tensor) -> Tensor:
        return self.native.where(condition, x, fill)

    def softmax(self, x: Tensor) -> Tensor:
        if x.shape[-1] == 0:  # no keys: nothing to normalise (and max() has no identity)
            return x
        return self.native.softmax(x)

    def cast(self, x: Tensor, dtype: Any) -> Tensor:
        return self.native.cast(x, dtype_name(dtype))

    def dtype(self, x: Tensor) -> str:
        return dtype_name(x.dtype)

    def dtype_kind(self, dtype: Any) -> str:
        return dtype_kind(dtype)

    def itemsize(self, dtype: Any) -> int:
        return _itemsize(dtype)

    def float32(self) -> str:
        return "float32"

    def ndim(self, x: Tensor) -> int:
        return len(x.shape)

    def any_last(self, x: Tensor) -> Tensor:
        return ops.any(x, axis=-1, keepdims=True)

    def logical_not(self, x: Tensor) -> Tensor:
        return ops.logical_not(x)

    def mean(self, x: Tensor, axis: int) -> Tensor:
        if dtype_name(x.dtype) == "float64":
            # Keras' mean accumulates float64 in float32 on its JAX and PyTorch
            # backends; its sum keeps float64 (the norms' mean square, docs:
            # "Positions and biases").
            return ops.sum(x, axis=axis, keepdims=True) / x.shape[axis]
        return ops.mean(x, axis=axis, keepdims=True)

    def gather_positions(self, x: Tensor, positions: Tensor) -> Tensor:
        # Whole rows of x as (B*T, F), one gather: take_along_axis would take
        # (B, M, F) indices, which TensorFlow gathers element by element (30
        # times slower for a decoding step of 8 x 288 positions of 512).
        batch = self.size(x, 0)
        starts = self.arange(batch) * self.size(x, 1)  # (B,): b*T
        rows = positions + ops.expand_dims(starts, 1)
        taken = ops.take(self.merge_axes(x, 0), rows, axis=0)
        if type(batch) is int and batch == 0:
            # (JAX takes no rows of an empty axis as (0, F), the indices' axes lost.)
            return self.native.reshape(taken, (0, self.size(positions, 1), self.size(x, 2)))
        return taken

    def slice_last(self, x: Tensor, start: int, stop: int) -> Tensor:
        return _slice_axis(x, -1, start, stop)

    def concat_last(self, xs: Sequence[Tensor]) -> Tensor:
        return ops.concatenate(list(xs), axis=-1)

    def cos(self, x: Tensor) -> Tensor:
        return _unary("cos", x)

    def sin(self, x: Tensor) -> Tensor:
        return _unary("sin", x)

    def tanh(self, x: Tensor) -> Tensor:
        return _unary("tanh", x)

    def largest(self, x: Tensor) -> Tensor:
        return ops.max(x)

    def rsqrt(self, x: Tensor) -> Tensor:
        return 1.0 / _unary("sqrt", x)

    def constant(self, value: np.ndarray, like: Tensor) -> Tensor:
        return self.native.constant(value, like)


def _slicer() -> Callable[[Tensor, int, int, int], Tensor | None]:
    """The active backend's cheapest slice of one axis, ``None`` where it has none for ``x``.

    The same elements as indexing, whose TensorFlow and JAX forms cost some
    150 to 260 Python calls a slice (a rotation takes two); PyTorch's costs
    one. (Only data moves: compiling the slice on JAX changes no number.)
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        def split(x: Tensor, axis: int, start: int, stop: int) -> Tensor | None:
            size = x.shape[axis]
            if not isinstance(size, int) or stop > size or isinstance(x, keras.KerasTensor):
                return None
            return tf.split(x, [start, stop - start, size - stop], axis=axis)[1]

        return split
    if backend == "jax":
        import jax

        # Compiled once per axis and size, the start an argument: an eager call
        # of it is one dispatch, and a start that moves call by call (a table's
        # rows at each decoding step) compiles nothing new.
        @functools.partial(jax.jit, static_argnums=(1, 3))
        def dynamic_slice(x: Tensor, axis: int, start: Any, size: int) -> Tensor:
            return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)

        def slice_in_dim(x: Tensor, axis: int, start: int, stop: int) -> Tensor | None:
            if isinstance(x, keras.KerasTensor) or stop > x.shape[axis]:
                return None
            return dynamic_slice(x, axis, start, stop - start)

        return slice_in_dim
    return lambda x, axis, start, stop: None


_SLICE = _slicer()


def _slice_axis(x: Tensor, axis: int, start: int, stop: int) -> Tensor:
    """``x``'s entries ``start`` to ``stop`` of ``axis`` (``0`` or ``-1``)."""
    # (Negative bounds, which some callers give, are indexing's.)
    sliced = _SLICE(x, axis, start, stop) if 0 <= start <= stop else None
    if sliced is not None:
        return sliced
    return x[start:stop] if axis == 0 else x[..., start:stop]


def first_rows(x: Tensor, start: int, stop: int) -> Tensor:
    """``x[start:stop]``: rows of the first axis (:meth:`mha_multi.call.Facts.first_rows`)."""
    return _slice_axis(x, 0, start, stop)


def rows_at(x: Tensor, index: np.ndarray) -> Tensor:
    """``x[index]``: rows of the first axis picked by integers on the host, one gather
    (:meth:`mha_multi.call.Facts.rows_at`)."""
    return OPS.native.rows_at(x, index)


def _unary(name: str, x: Tensor) -> Tensor:
    """``keras.ops.<name>(x)`` in ``x``'s dtype.

    Keras' JAX backend computes these in ``result_type(x, float)``, which is
    float32 for float64 inputs; JAX's own function keeps float64 (the
    reference's angles and caps are float64 there). Each backend's own
    function (:mod:`mha_multi.keras._framework_ops`).
    """
    return OPS.native.unary(name, x)


OPS = KerasOps()
