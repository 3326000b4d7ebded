"""The semantics of multi-head attention, written once.

Every function here takes an *array-ops adapter* (``ops``) as its first
argument: a small object with the handful of array operations the math needs
(see :class:`ArrayOps`). :class:`NumpyOps` evaluates the spec in float64 and is
the reference; each backend passes its own adapter, so the head layout, the
``valid_lens`` rule, the causal rule and the masked softmax exist in exactly
one place.

The operations are chosen so that no function needs a concrete shape: head
splitting is ``split_axis``/``merge_axes``, and sizes are what ``ops.size``
returns (ints where shapes are known, an adapter's own handle where they are
not) and become positions only through ``ops.arange``. This lets symbolic
frameworks (MXNet's hybridized graphs) share the same code as eager ones.

Shapes, following d2l: queries ``(B, Q, query_size)``, keys
``(B, K, key_size)``, values ``(B, K, value_size)``, ``num_hiddens = H * head_dim``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

__all__ = [
    "MASK_VALUE",
    "FUSED_SCORE_LIMIT",
    "ArrayOps",
    "FusedKernel",
    "Heads",
    "KVCache",
    "CacheFill",
    "SPAN_BUCKET",
    "DEVICE_READ_SCORES",
    "DEVICE_READ_TOTAL_SCORES",
    "KernelPlan",
    "NumpyDtypes",
    "NumpyOps",
    "apply_head_mask",
    "attention",
    "attention_by_kv_heads",
    "cache_shape",
    "check_cache_dtypes",
    "check_cache_values",
    "check_cached_call",
    "check_cached_inputs",
    "check_config",
    "check_sizes_known",
    "check_head_mask",
    "check_heads",
    "grouped_to_heads",
    "heads_of_weights",
    "heads_to_grouped",
    "check_causal",
    "check_inputs",
    "clip_integer_lens",
    "lens_as_numpy",
    "check_valid_lens_dtype",
    "is_low_precision",
    "magnitude_limit",
    "masked_softmax",
    "plan_kernel",
    "reads_values",
    "scores_within_limit",
    "reference_cached_forward",
    "reference_forward",
    "reference_gradients",
    "rounded_span",
    "scaled_scores",
    "shard_heads",
    "static_split_sizes",
    "transpose_grouped_output",
    "transpose_grouped_queries",
    "transpose_output",
    "transpose_qkv",
    "update_cache",
    "visibility",
    "LayerOptions",
    "Llama3Scaling",
    "NO_OPTIONS",
    "Rotary",
    "ScoreOptions",
    "adjust_scores",
    "alibi_slopes",
    "cache_positions",
    "call_positions",
    "check_alibi",
    "check_bias",
    "check_positions",
    "check_rotary",
    "check_softcap",
    "check_window",
    "distance_back",
    "rotary_tables",
    "rotate",
    "score_bias",
]

#: Hidden scores are *replaced* by this value before the softmax (d2l's rule).
#: A row whose keys are all hidden therefore gets uniform weights ``1/K``.
MASK_VALUE = -1e6

#: Bound on every score ``|q . k| / sqrt(head_dim)`` within which a kernel
#: that *adds* a large negative mask gives the spec's weights. The spec
#: replaces hidden scores by :data:`MASK_VALUE`: the two agree only where
#: every hidden key's weight is exactly 0 both ways, i.e. where no visible
#: score of a row lies near or below -1e6 (``exp(-5e5)`` is 0 in every float
#: type). :func:`scores_within_limit` tests it from the projections' largest
#: magnitudes.
FUSED_SCORE_LIMIT: float = -MASK_VALUE / 2

Array = Any


def _torch_compiling() -> bool:
    """Whether ``torch.compile`` is tracing (torch is only looked for, never imported).

    Its tracer warns about every ``functools.lru_cache`` it passes through.
    """
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def _decided_once(
    function: Callable[..., Any] | None = None,
    *,
    canonical: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Any:
    """``function`` (pure), computed once per arguments where they can be hashed.

    A call's checks and plan depend on shapes and flags alone, so every call
    of a layer after the first with the same shapes is a lookup: a small
    call's fixed cost is mostly such Python work. A call that raises is not
    remembered (it raises again); ``typed`` keeps ``True`` and ``1`` apart.
    Arguments that cannot be hashed (arrays, some traced sizes) are worked
    out each time. ``canonical`` maps the keyword arguments to ones with the
    same result, fewer in kind (a decoding step's growing sizes to how they
    compare), so that more calls are lookups.
    """
    if function is None:
        return functools.partial(_decided_once, canonical=canonical)
    once = functools.lru_cache(maxsize=4096, typed=True)(function)

    @functools.wraps(function)
    def decided(*args: Any, **kwargs: Any) -> Any:
        if _torch_compiling():
            return function(*args, **kwargs)  # a graph is traced once anyway
        if canonical is not None:
            kwargs = canonical(kwargs)
        try:
            return once(*args, **kwargs)
        except Exception:
            # Unhashable arguments (TypeError, or MXNet arrays'
            # NotImplementedError), or the function's own error: computed
            # again outside this handler, it raises that error on its own
            # (nothing failing is remembered).
            pass
        return function(*args, **kwargs)

    return decided


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
        """

    def cast(self, x: Array, dtype: Any) -> Array: ...

    def dtype(self, x: Array) -> Any: ...

    def dtype_kind(self, dtype: Any) -> str:
        """numpy's ``dtype.kind`` for a dtype of this framework ('f', 'i', ...)."""

    def itemsize(self, dtype: Any) -> int: ...

    def float32(self) -> Any: ...

    def ndim(self, x: Array) -> int: ...

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


class NumpyOps(NumpyDtypes):
    """The spec on numpy; with float64 inputs this is the reference."""

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

    def size(self, x: np.ndarray, axis: int) -> int:
        return np.shape(x)[axis]

    def arange(self, size: int) -> np.ndarray:
        return np.arange(size, dtype=np.int64)

    def flip(self, x: np.ndarray) -> np.ndarray:
        return x[::-1]

    def less(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.less(a, b)

    def greater_equal(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.greater_equal(a, b)

    def logical_and(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.logical_and(a, b)

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

    def logical_not(self, x: np.ndarray) -> np.ndarray:
        return np.logical_not(x)

    def mean(self, x: np.ndarray, axis: int) -> np.ndarray:
        return np.mean(x, axis=axis, keepdims=True)

    def gather_positions(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return np.take_along_axis(x, positions[..., None], axis=1)

    def slice_last(self, x: np.ndarray, start: int, stop: int) -> np.ndarray:
        return x[..., start:stop]

    def concat_last(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate(list(xs), axis=-1)

    def cos(self, x: np.ndarray) -> np.ndarray:
        return np.cos(x)

    def sin(self, x: np.ndarray) -> np.ndarray:
        return np.sin(x)

    def tanh(self, x: np.ndarray) -> np.ndarray:
        return np.tanh(x)

    def constant(self, value: np.ndarray, like: Any) -> np.ndarray:
        return np.asarray(value)


# --------------------------------------------------------------------------
# Configuration and input checks (pure Python: shapes and dtypes only)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Heads:
    """The head layout of a layer (docs: "The spec", grouped-query attention).

    Query head ``h`` reads key/value head ``h // group_size``; with
    ``num_kv_heads == num_heads`` this is d2l's multi-head attention, with
    ``num_kv_heads == 1`` multi-query attention.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def grouped(self) -> bool:
        """Whether key/value heads are shared (``num_kv_heads < num_heads``)."""
        return self.num_kv_heads != self.num_heads

    @property
    def query_features(self) -> int:
        """``num_heads * head_dim``: the width of projected queries and of ``W_o``'s input."""
        return self.num_heads * self.head_dim

    @property
    def kv_features(self) -> int:
        """``num_kv_heads * head_dim``: the width of projected keys and values."""
        return self.num_kv_heads * self.head_dim


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int; got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value}")


def check_heads(
    num_hiddens: Any, num_heads: Any, *, num_kv_heads: Any = None, head_dim: Any = None
) -> Heads:
    """Validates the head configuration.

    Args:
        num_hiddens: the output size of the layer.
        num_heads: the number of query heads ``H``.
        num_kv_heads: the number of key/value heads; ``None`` for ``num_heads``.
            Must divide ``num_heads``.
        head_dim: the size of each head; ``None`` for ``num_hiddens // num_heads``
            (which ``num_heads`` must then divide).

    Raises:
        TypeError: a size is not an integer.
        ValueError: a non-positive size, ``num_kv_heads`` not dividing
            ``num_heads``, or ``num_hiddens`` not divisible by ``num_heads``
            without an explicit ``head_dim``.
    """
    _check_positive_int("num_hiddens", num_hiddens)
    _check_positive_int("num_heads", num_heads)
    if num_kv_heads is None:
        num_kv_heads = num_heads
    _check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    if head_dim is None:
        if num_hiddens % num_heads:
            raise ValueError(
                f"num_hiddens ({num_hiddens}) must be divisible by num_heads ({num_heads}), "
                "or head_dim must be given"
            )
        head_dim = num_hiddens // num_heads
    _check_positive_int("head_dim", head_dim)
    return Heads(int(num_heads), int(num_kv_heads), int(head_dim))


def shard_heads(heads: Heads, num_shards: Any) -> Heads:
    """The head layout each of ``num_shards`` devices holds when heads are sharded.

    Tensor parallelism over heads (docs: "Sharding heads"): ``W_q``, ``W_k``
    and ``W_v`` are split by heads (columns), ``W_o`` by rows, so shard ``s``
    holds query heads ``[s * H / n, (s + 1) * H / n)`` and the key/value heads
    they read, ``[s * H_kv / n, (s + 1) * H_kv / n)``. A key/value head is
    never split, so ``num_shards`` must divide both head counts.

    Raises:
        TypeError: ``num_shards`` is not an int.
        ValueError: ``num_shards`` is not positive or does not divide
            ``num_heads`` and ``num_kv_heads``.
    """
    _check_positive_int("num_shards", num_shards)
    for name, count in (("num_heads", heads.num_heads), ("num_kv_heads", heads.num_kv_heads)):
        if count % num_shards:
            raise ValueError(
                f"the number of shards ({num_shards}) must divide {name} ({count}); "
                f"the layer has num_heads={heads.num_heads}, num_kv_heads={heads.num_kv_heads}"
            )
    n = int(num_shards)
    return Heads(heads.num_heads // n, heads.num_kv_heads // n, heads.head_dim)


def check_config(
    num_hiddens: Any,
    num_heads: Any,
    dropout: Any,
    *,
    num_kv_heads: Any = None,
    head_dim: Any = None,
) -> int:
    """Validates the layer configuration and returns ``head_dim``.

    Raises:
        TypeError: a size is not an integer or ``dropout`` not a number.
        ValueError: a bad head configuration (:func:`check_heads`), or
            ``dropout`` outside ``[0, 1)``.
    """
    heads = check_heads(num_hiddens, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.floating, np.integer)):
        raise TypeError(f"dropout must be a float in [0, 1); got {dropout!r}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be in [0, 1); got {dropout}")
    return heads.head_dim


def check_input_sizes(**sizes: Any) -> None:
    """Validates optional input sizes (``query_size=...`` etc.): positive ints or None."""
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive int or None; got {value!r}")


def check_sizes_known(sizes: Mapping[str, int | None]) -> None:
    """Raises ``ValueError`` unless every input size of a layer (its ``input_sizes()``) is known.

    A layer's weights are whole only once its lazy input sizes are fixed.
    """
    lazy = [name for name, size in sizes.items() if size is None]
    if lazy:
        raise ValueError(
            f"{', '.join(lazy)} not known yet: call the layer once or pass them to the constructor"
        )


def check_causal(causal: Any) -> None:
    """Raises ``TypeError`` unless ``causal`` is a bool.

    A string such as ``"False"`` is truthy and an array has no single truth
    value, so anything but a bool would silently turn the mask on or fail
    deep inside a framework.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {causal!r} of type {type(causal).__name__}")


@_decided_once
def check_inputs(
    queries_shape: Sequence[int],
    keys_shape: Sequence[int],
    values_shape: Sequence[int],
    valid_lens_shape: Sequence[int] | None = None,
    *,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
    causal: Any = False,
) -> None:
    """Validates input shapes against each other and the layer's input sizes.

    Args:
        queries_shape: ``(B, Q, query_size)``.
        keys_shape: ``(B, K, key_size)``.
        values_shape: ``(B, K, value_size)``.
        valid_lens_shape: ``None``, ``(B,)`` or ``(B, Q)``.
        query_size, key_size, value_size: the layer's input sizes, or ``None``
            where not yet known.
        causal: the call's ``causal`` flag (checked by :func:`check_causal`).

    Raises:
        ValueError: naming the offending argument and the expected shape.
        TypeError: ``causal`` is not a bool.
    """
    check_causal(causal)
    names = ("queries", "keys", "values")
    shapes = [tuple(queries_shape), tuple(keys_shape), tuple(values_shape)]
    sizes = (query_size, key_size, value_size)
    size_names = ("query_size", "key_size", "value_size")
    for name, shape in zip(names, shapes, strict=True):
        if len(shape) != 3:
            raise ValueError(f"{name} must be 3-D (batch, length, features); got shape {shape}")
    batch = shapes[0][0]
    for name, shape in zip(names[1:], shapes[1:], strict=True):
        if shape[0] != batch:
            raise ValueError(
                f"{name} batch size {shape[0]} differs from queries batch size {batch}"
            )
    if shapes[1][1] != shapes[2][1]:
        raise ValueError(
            f"keys and values must have the same length; got {shapes[1][1]} keys "
            f"and {shapes[2][1]} values"
        )
    for name, size_name, shape, size in zip(names, size_names, shapes, sizes, strict=True):
        if size is not None and shape[2] != size:
            raise ValueError(f"{name} last dimension must be {size_name}={size}; got shape {shape}")
    if valid_lens_shape is not None:
        lens_shape = tuple(valid_lens_shape)
        num_queries = shapes[0][1]
        if not _one_of(lens_shape, (batch,), (batch, num_queries)):
            raise ValueError(
                f"valid_lens must have shape (batch,) = ({batch},) or "
                f"(batch, num_queries) = ({batch}, {num_queries}); got {lens_shape}"
            )


def _one_of(shape: tuple[Any, ...], *allowed: tuple[Any, ...]) -> bool:
    """Whether ``shape`` equals one of the ``allowed`` shapes.

    Compared one shape at a time with ``==``: ``torch.compile`` traces ``x
    in (a, b)`` as false where a size in it is symbolic (once the queries'
    length varies) and the equal size it meets is not, so a call's valid
    ``positions``, lengths or ``bias`` was refused there.
    """
    return any(shape == candidate for candidate in allowed)


def check_valid_lens_dtype(kind: str) -> None:
    """Raises ``TypeError`` unless ``kind`` (numpy dtype kind) is integer or float."""
    if kind not in "iuf":
        raise TypeError(
            f"valid_lens must be an integer or floating-point array; got dtype kind {kind!r}"
        )


def lens_as_numpy(valid_lens: Any, index_dtype: Any) -> np.ndarray:
    """Lengths given as a numpy array, a list or a scalar, checked and converted.

    What each backend does with lengths that are not yet its own arrays.

    Args:
        valid_lens: array-like lengths.
        index_dtype: the framework's integer type; integer lengths are clipped
            into it (:func:`clip_integer_lens`), floating ones kept.

    Raises:
        TypeError: ``valid_lens`` is not numeric (strings, booleans, objects).
    """
    try:
        array = np.asarray(valid_lens)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"valid_lens must be an integer or floating-point array; got {valid_lens!r}"
        ) from error
    check_valid_lens_dtype(array.dtype.kind)
    return clip_integer_lens(array, index_dtype)


def clip_integer_lens(valid_lens: np.ndarray, dtype: Any) -> np.ndarray:
    """Integer lengths converted to the integer ``dtype`` by clipping, never wrapping.

    A framework that counts in 32 bits (JAX without x64) would wrap ``2**62``
    to 0 and hide every key. Lengths at or beyond the key count all hide
    nothing and lengths at or below 0 all hide everything, so clipping to the
    target's range keeps the meaning of every length (key counts fit in it).
    Floating lengths are returned unchanged.
    """
    valid_lens = np.asarray(valid_lens)
    if valid_lens.dtype.kind not in "iu":
        return valid_lens
    info = np.iinfo(dtype)
    # Compare in Python ints: numpy would wrap or promote uint64 against int32 bounds.
    if valid_lens.size and (int(valid_lens.min()) < info.min or int(valid_lens.max()) > info.max):
        low = np.array(info.min).astype(valid_lens.dtype) if valid_lens.dtype.kind == "i" else 0
        valid_lens = np.clip(valid_lens, low, np.array(info.max).astype(valid_lens.dtype))
    return valid_lens.astype(dtype)


# --------------------------------------------------------------------------
# Positions and biases (docs: "Positions and biases"): the options' values
# --------------------------------------------------------------------------


def _check_real(name: str, value: Any) -> float:
    """``value`` as a positive finite float; ``name`` is the argument's name in messages."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"{name} must be a positive finite number; got {value!r}")
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{name} must be a positive finite number; got {value!r}")
    return float(value)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3's scaling of the rotary frequencies (transformers' ``rope_type="llama3"``).

    A frequency ``f`` of wavelength ``2 pi / f`` shorter than
    ``original_max_position_embeddings / high_freq_factor`` is kept, one
    longer than ``original_max_position_embeddings / low_freq_factor`` is
    divided by ``factor``, and the others are interpolated between the two
    (transformers' ``_compute_llama3_parameters``).

    Raises:
        TypeError: a field is not a number (``original_max_position_embeddings``
            not an int).
        ValueError: a field is not positive and finite, or
            ``high_freq_factor <= low_freq_factor``.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(
                self, name, _check_real(f"rotary.scaling.{name}", getattr(self, name))
            )
        if self.high_freq_factor <= self.low_freq_factor:
            # The interpolation divides by their difference.
            raise ValueError(
                f"rotary.scaling.high_freq_factor ({self.high_freq_factor}) must be greater "
                f"than rotary.scaling.low_freq_factor ({self.low_freq_factor})"
            )
        _check_positive_int(
            "rotary.scaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
        )
        object.__setattr__(
            self, "original_max_position_embeddings", int(self.original_max_position_embeddings)
        )

    def apply(self, inverse_frequencies: np.ndarray) -> np.ndarray:
        """The scaled frequencies, float64, in the order of transformers' computation."""
        inv = np.asarray(inverse_frequencies, dtype=np.float64)
        old = float(self.original_max_position_embeddings)
        low_wavelength = old / self.low_freq_factor
        high_wavelength = old / self.high_freq_factor
        wavelength = 2 * math.pi / inv
        scaled = np.where(wavelength > low_wavelength, inv / self.factor, inv)
        smooth = (old / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelength < high_wavelength) & ~(wavelength > low_wavelength)
        return np.where(medium, smoothed, scaled)


def _check_scaling(scaling: Any) -> Llama3Scaling | None:
    if scaling is None or isinstance(scaling, Llama3Scaling):
        return scaling
    if not isinstance(scaling, Mapping):
        raise TypeError(
            "rotary.scaling must be None, a mha_multi.spec.Llama3Scaling or a dict with keys "
            f"{', '.join(_LLAMA3_KEYS)}; got {scaling!r}"
        )
    fields = dict(scaling)
    # transformers' rope_scaling names its type; only Llama 3's is defined here.
    for type_key in ("rope_type", "type"):
        if type_key in fields and fields.pop(type_key) != "llama3":
            raise ValueError(
                f"rotary.scaling {type_key} must be 'llama3' (the only scaling defined); "
                f"got {scaling[type_key]!r}"
            )
    unknown = sorted(set(fields) - set(_LLAMA3_KEYS))
    missing = [key for key in _LLAMA3_KEYS if key not in fields]
    if unknown or missing:
        raise ValueError(
            f"rotary.scaling must have the keys {', '.join(_LLAMA3_KEYS)}; "
            f"unknown {unknown}, missing {missing}"
        )
    return Llama3Scaling(**fields)


@dataclass(frozen=True)
class Rotary:
    """Rotary position embeddings of the projected queries and keys (RoFormer; Llama).

    Attributes:
        theta: the base of the frequencies ``theta ** (-2 i / dim)``.
        fraction: the rotated share of ``head_dim`` (partial rotary, as
            transformers' ``partial_rotary_factor``): the first
            :meth:`dim` entries of each head rotate, the rest pass unchanged.
        interleaved: ``False`` pairs entry ``i`` with ``i + dim / 2``
            (transformers' ``rotate_half``); ``True`` pairs ``2 i`` with
            ``2 i + 1`` (the RoFormer paper, GPT-J).
        scaling: ``None``, or Llama 3's frequency scaling (a
            :class:`Llama3Scaling` or a dict of its fields).

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range,
            naming it.
    """

    theta: float = 10000.0
    fraction: float = 1.0
    interleaved: bool = False
    scaling: Llama3Scaling | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "theta", _check_real("rotary.theta", self.theta))
        fraction = _check_real("rotary.fraction", self.fraction)
        if fraction > 1.0:
            raise ValueError(f"rotary.fraction must be in (0, 1]; got {self.fraction!r}")
        object.__setattr__(self, "fraction", fraction)
        if not isinstance(self.interleaved, (bool, np.bool_)):
            raise TypeError(f"rotary.interleaved must be a bool; got {self.interleaved!r}")
        object.__setattr__(self, "interleaved", bool(self.interleaved))
        object.__setattr__(self, "scaling", _check_scaling(self.scaling))

    def dim(self, head_dim: int) -> int:
        """The rotated size of a head: ``int(head_dim * fraction)``, as transformers rounds it.

        Raises:
            ValueError: that size is odd or 0 (entries rotate in pairs).
        """
        _check_positive_int("head_dim", head_dim)
        rotated = int(head_dim * self.fraction)
        if rotated < 2 or rotated % 2:
            raise ValueError(
                f"rotary.fraction ({self.fraction}) of head_dim ({head_dim}) rotates "
                f"{rotated} entries; rotation needs an even number, at least 2"
            )
        return rotated

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        """``(dim / 2,)`` float64 frequencies ``theta ** (-2 i / dim)``, scaled if asked.

        Computed on the host, once, in float64; backends take them as
        constants (:meth:`ArrayOps.constant`), rounded to float32 for inputs
        of 32 bits or fewer.
        """
        rotated = self.dim(head_dim)
        inv = 1.0 / self.theta ** (np.arange(0, rotated, 2, dtype=np.float64) / rotated)
        return inv if self.scaling is None else self.scaling.apply(inv)


_ROTARY_KEYS = ("theta", "fraction", "interleaved", "scaling")


def check_rotary(rotary: Any) -> Rotary | None:
    """The layer's ``rotary=`` argument as a :class:`Rotary` (or ``None``).

    Raises:
        TypeError: not ``None``, a :class:`Rotary` or a dict; or a field of
            the wrong type.
        ValueError: a dict with other keys, or a field out of range.
    """
    if rotary is None or isinstance(rotary, Rotary):
        return rotary
    if not isinstance(rotary, Mapping):
        raise TypeError(
            "rotary must be None, a mha_multi.spec.Rotary or a dict with keys "
            f"{', '.join(_ROTARY_KEYS)}; got {rotary!r}"
        )
    unknown = sorted(set(rotary) - set(_ROTARY_KEYS))
    if unknown:
        raise ValueError(
            f"rotary has unknown keys {unknown}; the keys are {', '.join(_ROTARY_KEYS)}"
        )
    return Rotary(**rotary)


def check_alibi(alibi: Any) -> bool:
    """Raises ``TypeError`` unless ``alibi`` is a bool (as :func:`check_causal`)."""
    if not isinstance(alibi, (bool, np.bool_)):
        raise TypeError(f"alibi must be a bool; got {alibi!r} of type {type(alibi).__name__}")
    return bool(alibi)


def check_window(window: Any) -> int | None:
    """``window`` as ``None`` or a positive int: the positions a query may see back.

    Raises:
        TypeError: not ``None`` or an int.
        ValueError: not positive (a window of 0 would hide every key).
    """
    if window is None:
        return None
    _check_positive_int("window", window)
    return int(window)


def check_softcap(softcap: Any) -> float | None:
    """``softcap`` as ``None`` or a positive finite float.

    Raises:
        TypeError: not ``None`` or a number.
        ValueError: not positive and finite.
    """
    return None if softcap is None else _check_real("softcap", softcap)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi slopes of ``num_heads`` heads, float64 ``(num_heads,)``.

    For ``H`` a power of two, head ``h`` (from 0) has ``2 ** (-8 (h + 1) / H)``
    (Press et al., 2022). Otherwise, as BLOOM's ``build_alibi_tensor``: the
    slopes of the largest power of two ``P < H``, then every other slope of
    ``2 P`` heads (``2 ** (-4 k / P)`` for odd ``k``) for the remaining
    ``H - P`` heads. Each slope is one float64 power of two, not a product of
    rounded powers.
    """
    _check_positive_int("num_heads", num_heads)
    closest = 1 << (int(num_heads).bit_length() - 1)
    slopes = np.exp2(-8.0 * np.arange(1, closest + 1) / closest)
    if closest == num_heads:
        return slopes
    odd = np.arange(1, 2 * (num_heads - closest), 2)
    return np.concatenate([slopes, np.exp2(-4.0 * odd / closest)])


def check_positions(
    positions_shape: Sequence[int],
    positions_kind: str,
    *,
    batch: int,
    num_queries: int,
    num_keys: int | None = None,
) -> None:
    """Validates a call's ``positions``: integer ``(B, Q)`` (or ``(1, Q)``, for every example).

    Args:
        positions_shape: the shape of ``positions``.
        positions_kind: its numpy dtype kind.
        batch: ``B``.
        num_queries: ``Q`` (``T`` of a cached call).
        num_keys: ``K`` of a call without a cache, where ``positions`` serve
            the keys too; ``None`` for a cached call (its new keys are its
            queries' positions).

    Raises:
        TypeError: ``positions`` is not integer.
        ValueError: another shape, or keys that are not the queries'
            sequence (``K != Q`` without a cache).
    """
    if positions_kind not in "iu":
        raise TypeError(f"positions must be integers; got dtype kind {positions_kind!r}")
    shape = tuple(positions_shape)
    if not _one_of(shape, (batch, num_queries), (1, num_queries)):
        raise ValueError(
            f"positions must have shape (batch, num_queries) = ({batch}, {num_queries}) "
            f"or (1, {num_queries}); got {shape}"
        )
    if num_keys is not None and num_keys != num_queries:
        raise ValueError(
            "positions serve the queries and the keys of self-attention, so without a cache "
            f"the keys must be as many as the queries; got {num_queries} queries and "
            f"{num_keys} keys (leave positions=None for cross-attention)"
        )


def check_bias(
    bias_shape: Sequence[int],
    bias_kind: str,
    *,
    batch: int,
    num_heads: int,
    num_queries: int,
    num_keys: int,
) -> None:
    """Validates a call's ``bias``: floating, broadcastable to ``(B, H, Q, K)``.

    With a cache, ``Q`` is the call's new positions ``T`` and ``K`` the
    cache's ``max_length``.

    Raises:
        TypeError: ``bias`` is not floating-point.
        ValueError: a shape numpy would not broadcast to ``(B, H, Q, K)``.
    """
    if bias_kind != "f":
        raise TypeError(f"bias must be a floating-point array; got dtype kind {bias_kind!r}")
    shape = tuple(bias_shape)
    target = (batch, num_heads, num_queries, num_keys)
    if len(shape) > 4 or any(
        # (Compared one by one: see _one_of.)
        not (size == 1 or size == full)
        for size, full in zip(shape[::-1], target[::-1], strict=False)
    ):
        raise ValueError(
            "bias must be broadcastable to (batch, num_heads, num_queries, num_keys) = "
            f"{target}; got shape {shape}"
        )


@dataclass(frozen=True, eq=False)
class ScoreOptions:
    """What one call does to the scaled scores of every head (docs: "Positions and biases").

    Attributes:
        softcap: ``None``, or ``c`` for ``c * tanh(s / c)`` (Gemma 2).
        bias: ``None``, or an additive bias broadcastable to ``(B, H, Q, K)``.
        alibi_slopes: ``None``, or the ``(H,)`` host slopes of the heads
            this call computes (:func:`alibi_slopes`, sliced where heads are
            sharded): ``slope[h] * (j - i_abs)`` is added.
        window: ``None``, or ``w``: key ``j`` is hidden from query ``i``
            unless ``i_abs - j < w``.
        query_positions: where the queries sit among the keys (key ``j`` sits
            at ``j``): ``None`` for ``i_abs = i + K - Q`` (the causal rule's
            bottom-right frame), or integer ``(B, Q)`` (``lengths[b] + i`` of
            a cached call). ALiBi, the window and the causal rule read it;
            the call's ``positions`` only rotate.
    """

    softcap: float | None = None
    bias: Array | None = None
    alibi_slopes: np.ndarray | None = None
    window: int | None = None
    query_positions: Array | None = None

    @property
    def adjusts_scores(self) -> bool:
        """Whether :func:`adjust_scores` changes the scores."""
        return self.softcap is not None or self.bias is not None or self.alibi_slopes is not None


#: No option: d2l's scores.
NO_OPTIONS = ScoreOptions()

_LAYER_OPTIONS = ("rotary", "alibi", "window", "softcap")


@dataclass(frozen=True)
class LayerOptions:
    """The constructor options of docs "Positions and biases"; the defaults are d2l's layer.

    Attributes:
        rotary: ``None`` or a :class:`Rotary` (a dict of its fields before
            :meth:`check`).
        alibi: add ALiBi's per-head linear bias (:func:`alibi_slopes`).
        window: ``None`` or the sliding window (:func:`check_window`).
        softcap: ``None`` or the soft cap of the scores (:func:`check_softcap`).
    """

    rotary: Rotary | Mapping[str, Any] | None = None
    alibi: bool = False
    window: int | None = None
    softcap: float | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> LayerOptions:
        """Checked options from keywords (``rotary=``, ...), naming an unknown one.

        Raises:
            TypeError: an unknown keyword, or a value of the wrong type.
            ValueError: a value out of range.
        """
        unknown = sorted(set(options) - set(_LAYER_OPTIONS))
        if unknown:
            raise TypeError(
                f"unknown option(s) {unknown}; the options are {', '.join(_LAYER_OPTIONS)}"
            )
        return cls(**options).check()

    def check(self, head_dim: int | None = None) -> LayerOptions:
        """These options validated, ``rotary`` as a :class:`Rotary`.

        Args:
            head_dim: the layer's head size, which the rotated share of
                ``rotary`` must fit (:meth:`Rotary.dim`); ``None`` to skip.

        Raises:
            TypeError, ValueError: from :func:`check_rotary`,
                :func:`check_alibi`, :func:`check_window`, :func:`check_softcap`,
                :meth:`Rotary.dim`.
        """
        options = LayerOptions(
            rotary=check_rotary(self.rotary),
            alibi=check_alibi(self.alibi),
            window=check_window(self.window),
            softcap=check_softcap(self.softcap),
        )
        if head_dim is not None and options.rotary is not None:
            options.rotary.dim(head_dim)
        return options

    def config(self) -> dict[str, Any]:
        """The options as plain Python values (``rotary`` a dict), as constructors take them."""
        rotary = self.rotary
        if isinstance(rotary, Rotary):
            rotary = dataclasses.asdict(rotary)
        return {
            "rotary": rotary,
            "alibi": self.alibi,
            "window": self.window,
            "softcap": self.softcap,
        }

    @property
    def is_default(self) -> bool:
        """Whether these are d2l's layer (no option set)."""
        return (
            self.rotary is None and not self.alibi and self.window is None and self.softcap is None
        )

    def score_options(
        self, *, num_heads: int, bias: Array | None = None, query_positions: Array | None = None
    ) -> ScoreOptions:
        """The :class:`ScoreOptions` of one call of a layer with these (checked) options.

        Args:
            num_heads: the heads whose ALiBi slopes the call needs.
            bias: the call's checked ``bias``, or ``None``.
            query_positions: ``None``, or a cached call's
                :func:`cache_positions`.
        """
        return ScoreOptions(
            softcap=self.softcap,
            bias=bias,
            alibi_slopes=alibi_slopes(num_heads) if self.alibi else None,
            window=self.window,
            query_positions=query_positions,
        )


# --------------------------------------------------------------------------
# The math
# --------------------------------------------------------------------------


def transpose_qkv(ops: ArrayOps, x: Array, num_heads: int) -> Array:
    """``(B, T, H*dh) -> (B*H, T, dh)``; the flat row index is ``b*H + h``."""
    x = ops.split_axis(x, 2, (num_heads, -1))  # (B, T, H, dh)
    x = ops.permute(x, (0, 2, 1, 3))  # (B, H, T, dh)
    return ops.merge_axes(x, 0)  # (B*H, T, dh)


def transpose_output(ops: ArrayOps, x: Array, num_heads: int) -> Array:
    """``(B*H, T, dh) -> (B, T, H*dh)``; the exact inverse of :func:`transpose_qkv`."""
    x = ops.split_axis(x, 0, (-1, num_heads))  # (B, H, T, dh)
    x = ops.permute(x, (0, 2, 1, 3))  # (B, T, H, dh)
    return ops.merge_axes(x, 2)


def transpose_grouped_queries(ops: ArrayOps, x: Array, num_kv_heads: int, group_size: int) -> Array:
    """``(B, Q, H*dh) -> (B*H_kv, G*Q, dh)`` for ``G = group_size`` query heads per key/value head.

    Query head ``h = j*G + g`` lands in row block ``b*H_kv + j`` at rows
    ``g*Q .. g*Q + Q - 1``, next to the other heads that read key/value head
    ``j``: one matrix product per key/value head serves its whole group, and
    no key or value is repeated. With ``G = 1`` it is :func:`transpose_qkv`.
    """
    x = ops.split_axis(x, 2, (num_kv_heads, -1))  # (B, Q, H_kv, G*dh)
    x = ops.split_axis(x, 3, (group_size, -1))  # (B, Q, H_kv, G, dh)
    x = ops.permute(x, (0, 2, 3, 1, 4))  # (B, H_kv, G, Q, dh)
    x = ops.merge_axes(x, 2)  # (B, H_kv, G*Q, dh)
    return ops.merge_axes(x, 0)


def transpose_grouped_output(ops: ArrayOps, x: Array, num_kv_heads: int, group_size: int) -> Array:
    """``(B*H_kv, G*Q, dh) -> (B, Q, H*dh)``: the inverse of :func:`transpose_grouped_queries`."""
    x = ops.split_axis(x, 0, (-1, num_kv_heads))  # (B, H_kv, G*Q, dh)
    x = ops.split_axis(x, 2, (group_size, -1))  # (B, H_kv, G, Q, dh)
    x = ops.permute(x, (0, 3, 1, 2, 4))  # (B, Q, H_kv, G, dh)
    x = ops.merge_axes(x, 3)  # (B, Q, H_kv, G*dh)
    return ops.merge_axes(x, 2)


def grouped_to_heads(ops: ArrayOps, x: Array, num_kv_heads: int, group_size: int) -> Array:
    """``(B*H_kv, G*Q, K) -> (B, H, Q, K)`` with ``h = j*G + g``."""
    x = ops.split_axis(x, 0, (-1, num_kv_heads))  # (B, H_kv, G*Q, K)
    x = ops.split_axis(x, 2, (group_size, -1))  # (B, H_kv, G, Q, K)
    return ops.merge_axes(x, 1)


def heads_to_grouped(ops: ArrayOps, x: Array, num_kv_heads: int, group_size: int) -> Array:
    """``(B, H, Q, K) -> (B*H_kv, G*Q, K)``: the inverse of :func:`grouped_to_heads`."""
    x = ops.split_axis(x, 1, (num_kv_heads, group_size))  # (B, H_kv, G, Q, K)
    x = ops.merge_axes(x, 2)  # (B, H_kv, G*Q, K)
    return ops.merge_axes(x, 0)


def visibility(
    ops: ArrayOps,
    num_queries: Any,
    num_keys: Any,
    valid_lens: Array | None,
    *,
    causal: bool = False,
    window: int | None = None,
    query_positions: Array | None = None,
) -> Array | None:
    """Which keys each query may see.

    Args:
        ops: the array-ops adapter.
        num_queries: ``Q``, as ``ops.size`` gives it (an int where known).
        num_keys: ``K``, likewise.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating.
            Key ``j`` is visible to query ``i`` of example ``b`` iff
            ``j < valid_lens[b]`` (or ``valid_lens[b, i]``).
        causal: additionally hide key ``j`` from query ``i`` when
            ``j > i_abs``, where ``i_abs = i + (K - Q)`` (bottom-right
            aligned) or ``query_positions[b, i]``.
        window: ``None``, or additionally hide key ``j`` from query ``i``
            unless ``i_abs - j < window`` (a sliding window; with
            ``causal`` each query sees at most ``window`` keys, itself
            included).
        query_positions: ``None``, or integer ``(B, Q)`` positions
            ``i_abs`` of the queries among the keys (a cached call's
            :func:`cache_positions`).

    Returns:
        ``None`` if every key is visible, else a boolean array broadcastable
        to ``(B, 1, Q, K)``: ``(B, 1, 1|Q, K)`` with lengths or query
        positions, ``(Q, K)`` with only ``causal`` and ``window``.
    """
    visible = None
    if valid_lens is not None:
        lens_dtype = ops.dtype(valid_lens)
        kind = ops.dtype_kind(lens_dtype)
        check_valid_lens_dtype(kind)
        # 16-bit floats cannot count past 256 (bf16) or 2048 (fp16) exactly.
        if kind == "f" and ops.itemsize(lens_dtype) < 4:
            valid_lens = ops.cast(valid_lens, ops.float32())
            lens_dtype = ops.dtype(valid_lens)
        key_positions = ops.arange(num_keys)  # (K,)
        positions_dtype = ops.dtype(key_positions)
        if kind in "iu" and ops.itemsize(lens_dtype) < ops.itemsize(positions_dtype):
            # Positions cast to int8 would wrap past 127: widen the lengths instead.
            valid_lens = ops.cast(valid_lens, positions_dtype)
        else:
            key_positions = ops.cast(key_positions, lens_dtype)
        lens = ops.expand_dims(valid_lens, -1)  # (B, 1) or (B, Q, 1)
        if ops.ndim(valid_lens) == 1:
            lens = ops.expand_dims(lens, -1)  # (B, 1, 1)
        visible = ops.expand_dims(ops.less(key_positions, lens), 1)  # (B, 1, 1|Q, K)
    rules = []
    if causal and query_positions is None:
        # j <= i + (K - Q)  <=>  K - 1 - j >= Q - 1 - i: distances from the end
        # need no concrete sizes.
        keys_from_end = ops.flip(ops.arange(num_keys))  # (K,)
        queries_from_end = ops.expand_dims(ops.flip(ops.arange(num_queries)), -1)
        rules.append(ops.greater_equal(keys_from_end, queries_from_end))  # (Q, K)
    elif causal:
        back = distance_back(ops, num_queries, num_keys, query_positions)
        rules.append(ops.greater_equal(back, back * 0))
    if window is not None:
        rules.append(ops.less(distance_back(ops, num_queries, num_keys, query_positions), window))
    for rule in rules:
        visible = rule if visible is None else ops.logical_and(visible, rule)
    return visible


def distance_back(
    ops: ArrayOps, num_queries: Any, num_keys: Any, query_positions: Array | None = None
) -> Array:
    """``i_abs - j``: how far key ``j`` lies behind query ``i`` (negative: ahead).

    Key ``j`` sits at position ``j``; query ``i`` at ``i_abs = i + K - Q``
    (the causal rule's frame) or, given them, at ``query_positions[b, i]``.

    Returns:
        Integers ``(Q, K)``, or ``(B, 1, Q, K)`` with 2-D ``query_positions``.
    """
    if query_positions is None:
        # (K - 1 - j) - (Q - 1 - i), from the end as the causal rule: no concrete sizes.
        keys_from_end = ops.flip(ops.arange(num_keys))  # (K,)
        return keys_from_end - ops.expand_dims(ops.flip(ops.arange(num_queries)), -1)
    key_positions = ops.arange(num_keys)
    # One integer dtype: some frameworks do not mix int32 and int64.
    positions = ops.cast(query_positions, ops.dtype(key_positions))
    back = ops.expand_dims(positions, -1) - key_positions  # (B, Q, K) or (Q, K)
    return ops.expand_dims(back, 1) if ops.ndim(query_positions) == 2 else back


def cache_positions(ops: ArrayOps, lengths: Array, num_new: Any) -> Array:
    """``lengths[b] + i``: the absolute positions of a cached call's ``T`` new rows.

    Args:
        ops: the array-ops adapter.
        lengths: the cache's ``(B,)`` lengths *before* the call.
        num_new: ``T``, as ``ops.size`` gives it.

    Returns:
        ``(B, T)`` integers of ``lengths``' dtype.
    """
    steps = ops.cast(ops.arange(num_new), ops.dtype(lengths))
    return ops.expand_dims(lengths, 1) + ops.expand_dims(steps, 0)


def call_positions(
    ops: ArrayOps,
    positions: Array | None,
    *,
    num_queries: Any,
    num_keys: Any,
    lengths: Array | None = None,
) -> tuple[Array, Array]:
    """The rotary positions of a call's queries and keys.

    Given ``positions`` (checked by :func:`check_positions`) serve both:
    the keys of self-attention, or a cached call's new keys, are the
    queries' sequence. Otherwise a cached call's rows sit at
    :func:`cache_positions` (each example its own, so ragged and
    left-padded batches rotate correctly) and an uncached call's at
    ``arange(Q)`` and ``arange(K)``.

    Args:
        ops: the array-ops adapter.
        positions: the call's ``positions`` ``(B, Q)`` or ``(1, Q)``, or ``None``.
        num_queries: ``Q`` (``T`` with a cache), as ``ops.size`` gives it.
        num_keys: ``K`` of an uncached call (unused with a cache).
        lengths: the cache's lengths before the call, or ``None`` without a cache.

    Returns:
        ``(query_positions, key_positions)``, integer, ``(B|1, Q)`` or ``(Q,)``.
    """
    if positions is not None:
        return positions, positions
    if lengths is not None:
        cached = cache_positions(ops, lengths, num_queries)
        return cached, cached
    return ops.arange(num_queries), ops.arange(num_keys)


def rotary_tables(
    ops: ArrayOps, x: Array, positions: Array, rotary: Rotary, head_dim: int
) -> tuple[Array, Array]:
    """The cosines and sines of the angles ``positions * inverse_frequencies``.

    The angles are float32 for inputs of 32 bits or fewer (float64 for
    float64), so 16-bit inputs rotate by float32 angles (docs: "Positions
    and biases"), and a float32 angle is the one rounding of the product of
    two float32 numbers, as transformers computes it.

    Args:
        ops: the array-ops adapter.
        x: what will be rotated; gives the angles' precision and device.
        positions: integer ``(B|1, T)`` or ``(T,)``.
        rotary: the rotation.
        head_dim: the size of each head.

    Returns:
        ``(cos, sin)``, each ``(B|1, T, 1, dim / 2)`` or ``(T, 1, dim / 2)``:
        one angle per rotated pair, the same for every head.
    """
    inv = rotary.inverse_frequencies(head_dim)
    wide = ops.itemsize(ops.dtype(x)) >= 8
    inv = ops.constant(inv if wide else inv.astype(np.float32), x)  # (dim/2,)
    angles = ops.expand_dims(ops.cast(positions, ops.dtype(inv)), -1) * inv  # (..., T, dim/2)
    angles = ops.expand_dims(angles, -2)  # (..., T, 1, dim/2): heads broadcast
    return ops.cos(angles), ops.sin(angles)


def rotate(
    ops: ArrayOps,
    x: Array,
    positions: Array,
    rotary: Rotary,
    num_heads: int,
    head_dim: int,
    inverse: bool = False,
    *,
    tables: tuple[Array, Array] | None = None,
) -> Array:
    """Rotary position embeddings of projected queries or keys.

    Each head's first ``dim = rotary.dim(head_dim)`` entries rotate in
    pairs by the angles of :func:`rotary_tables`: ``(x1, x2) -> (x1 cos -
    x2 sin, x2 cos + x1 sin)``, pairing entry ``i`` with ``i + dim / 2``
    (transformers' ``q * cos + rotate_half(q) * sin``, bit for bit) or, with
    ``rotary.interleaved``, ``2 i`` with ``2 i + 1``; the other ``head_dim -
    dim`` entries pass unchanged. The product is computed in the angles'
    precision and rounded once to ``x``'s dtype.

    Args:
        ops: the array-ops adapter.
        x: projected ``(B, T, num_heads * head_dim)``.
        positions: integer ``(B|1, T)`` or ``(T,)`` (:func:`call_positions`).
        rotary: the rotation.
        num_heads: the heads of ``x`` (key/value heads for keys).
        head_dim: the size of each head.
        inverse: rotate by the opposite angles (the transpose: what a
            gradient goes through).
        tables: :func:`rotary_tables` for these positions, where already
            computed (queries and keys at the same positions).

    Returns:
        ``x`` rotated, same shape and dtype.
    """
    dtype = ops.dtype(x)
    cos, sin = rotary_tables(ops, x, positions, rotary, head_dim) if tables is None else tables
    if inverse:
        sin = -sin
    heads = ops.split_axis(x, 2, (num_heads, head_dim))  # (B, T, H, dh)
    if ops.dtype(cos) != dtype:
        heads = ops.cast(heads, ops.dtype(cos))
    rotated = rotary.dim(head_dim)
    half = rotated // 2
    part = heads if rotated == head_dim else ops.slice_last(heads, 0, rotated)
    if rotary.interleaved:
        pairs = ops.split_axis(part, 3, (half, 2))  # (B, T, H, dim/2, 2)
        first, second = ops.slice_last(pairs, 0, 1), ops.slice_last(pairs, 1, 2)
        cos, sin = ops.expand_dims(cos, -1), ops.expand_dims(sin, -1)
        turned = ops.concat_last([first * cos - second * sin, second * cos + first * sin])
        turned = ops.merge_axes(turned, 3)  # back to (B, T, H, dim), pairs adjacent
    else:
        first, second = ops.slice_last(part, 0, half), ops.slice_last(part, half, rotated)
        turned = ops.concat_last([first * cos - second * sin, second * cos + first * sin])
    if rotated < head_dim:
        turned = ops.concat_last([turned, ops.slice_last(heads, rotated, head_dim)])
    out = ops.merge_axes(turned, 2)
    return out if ops.dtype(out) == dtype else ops.cast(out, dtype)


def score_bias(
    ops: ArrayOps, options: ScoreOptions, num_queries: Any, num_keys: Any, like: Array
) -> Array | None:
    """The additive bias of the scores: the call's ``bias`` plus the ALiBi term.

    ALiBi adds ``slope[h] * (j - i_abs)`` (:func:`distance_back` gives
    ``i_abs - j``), computed in float32 (float64 for float64 ``like``)
    from the host slopes. What :func:`adjust_scores` adds, and what a fused
    kernel that takes a bias is given.

    Args:
        ops: the array-ops adapter.
        options: the call's options.
        num_queries, num_keys: ``Q`` and ``K``, as ``ops.size`` gives them.
        like: an array of the dtype (and device) of the bias, such as the scores.

    Returns:
        ``None`` without bias or ALiBi, else an array of ``like``'s dtype
        broadcastable to ``(B, H, Q, K)``.
    """
    dtype = ops.dtype(like)
    bias = options.bias
    if options.alibi_slopes is not None:
        slopes = -np.asarray(options.alibi_slopes, dtype=np.float64)  # (j - i) = -(i - j)
        slopes = ops.constant(
            slopes if ops.itemsize(dtype) >= 8 else slopes.astype(np.float32), like
        )
        slopes = ops.expand_dims(ops.expand_dims(slopes, -1), -1)  # (H, 1, 1)
        back = distance_back(ops, num_queries, num_keys, options.query_positions)
        alibi = ops.cast(back, ops.dtype(slopes)) * slopes  # (H, Q, K) or (B, H, Q, K)
        bias = alibi if bias is None else alibi + ops.cast(bias, ops.dtype(alibi))
    if bias is None:
        return None
    return bias if ops.dtype(bias) == dtype else ops.cast(bias, dtype)


def adjust_scores(ops: ArrayOps, scores: Array, options: ScoreOptions) -> Array:
    """The scaled scores of every head after soft-capping and the additive bias.

    Order of docs "Positions and biases": ``softcap * tanh(s / softcap)``,
    then ``+ (bias + slope[h] * (j - i_abs))`` (:func:`score_bias`, summed
    first as a kernel given one bias sums them). The masks come after, and
    *replace* hidden scores (:func:`masked_softmax`), so a hidden key stays
    hidden whatever its bias.

    Args:
        ops: the array-ops adapter.
        scores: ``(B, H, Q, K)`` scaled scores (float32 for 16-bit inputs).
        options: the call's options.

    Returns:
        The adjusted scores, same shape and dtype.
    """
    if options.softcap is not None:
        scores = ops.tanh(scores / options.softcap) * options.softcap
    bias = score_bias(ops, options, ops.size(scores, 2), ops.size(scores, 3), scores)
    return scores if bias is None else scores + bias


@dataclass(frozen=True)
class FusedKernel:
    """What a backend's fused attention kernel can be given: the facts
    :func:`plan_kernel` decides from, so that every backend decides by the
    same rules (docs: "Fast paths").

    Attributes:
        name: the kernel, for messages and tests.
        takes_dropout: applies dropout to its weights itself, as the spec does.
        takes_key_lengths: takes per-example key lengths ``(B,)`` (integer
            lengths need no mask then).
        causal_flag: has its own (top-left aligned) causal flag.
        mask_and_causal: takes a boolean mask (or a bias) together with that flag.
        replaces_hidden_scores: hides keys by *replacing* their scores, as the
            spec does. A kernel that *adds* ``-inf`` lets a hidden key's
            non-finite score through, and may turn a NaN row into zeros, so it
            runs only where the caller read the values and found them exact
            (``values_exact``).
        hidden_rows_uniform: gives a query that sees no key uniform weights,
            as the spec does (it masks with ``MASK_VALUE`` itself), so no row
            needs :func:`fix_fully_hidden_rows`.
        takes_grouped_heads: takes fewer key/value heads than query heads
            (grouped-query attention) without their being repeated.
        takes_bias: takes a floating bias added to the scaled scores before
            its masks (:func:`score_bias`: the call's ``bias`` and ALiBi).
        takes_softcap: soft-caps the scaled scores itself, ``c * tanh(s /
            c)``, before the bias and the masks.
        takes_window: has its own sliding window beside its mask and causal
            flag, top-left aligned: key ``j`` is hidden from query ``i``
            unless ``i - j < window`` (used only where that is the spec's
            frame; the boolean mask holds the window otherwise).
    """

    name: str
    takes_dropout: bool = False
    takes_key_lengths: bool = False
    causal_flag: bool = True
    mask_and_causal: bool = False
    replaces_hidden_scores: bool = False
    hidden_rows_uniform: bool = False
    takes_grouped_heads: bool = False
    takes_bias: bool = False
    takes_softcap: bool = False
    takes_window: bool = False


@dataclass(frozen=True)
class KernelPlan:
    """What one call gives a fused kernel, or that it takes the generic path.

    Attributes:
        fused: whether the fused kernel runs at all.
        reason: why not, when ``fused`` is false (for messages and tests).
        is_causal: pass the kernel's own causal flag (top-left aligned, which
            is the spec's rule because ``Q == K``).
        key_lengths: pass the ``(B,)`` lengths as the kernel's key lengths.
        mask_lens: the boolean mask holds the lengths.
        mask_causal: the boolean mask holds the causal rule.
        fix_rows: rows may be fully hidden; give them the spec's value with
            :func:`fix_fully_hidden_rows` and :meth:`fix_visibility`.
        fix_causal: the causal rule can hide whole rows (``Q > K``).
        repeat_kv: grouped key/value heads must be repeated (once, on the
            projected heads) for a kernel that takes no groups.
        bias: give the kernel the additive bias, :func:`score_bias` (the
            call's ``bias`` and ALiBi).
        softcap: give the kernel the soft cap.
        window_flag: give the kernel the window, as its own sliding window
            (the frames agree: ``Q == K`` and no query positions).
        mask_window: the boolean mask holds the window rule.
        fix_window: the window can hide whole rows (with lengths, or query
            positions): :meth:`fix_visibility` includes it.
        guarded: the values were not read (a compiled graph): the kernel's
            context is taken where the values are exact, as the device finds
            them, and the generic path's elsewhere, one conditional in the
            graph (docs: "Fast paths").
    """

    fused: bool
    reason: str = ""
    is_causal: bool = False
    key_lengths: bool = False
    mask_lens: bool = False
    mask_causal: bool = False
    fix_rows: bool = False
    fix_causal: bool = False
    repeat_kv: bool = False
    bias: bool = False
    softcap: bool = False
    window_flag: bool = False
    mask_window: bool = False
    fix_window: bool = False
    guarded: bool = False

    @property
    def needs_mask(self) -> bool:
        return self.mask_lens or self.mask_causal or self.mask_window

    def mask(
        self,
        ops: ArrayOps,
        num_queries: Any,
        num_keys: Any,
        valid_lens: Array | None,
        options: ScoreOptions = NO_OPTIONS,
    ) -> Array | None:
        """The boolean mask the kernel is given (``None`` where it needs none).

        ``options`` gives the window and the query positions (those of the
        call the plan was made for).
        """
        if not self.needs_mask:
            return None
        lens = valid_lens if self.mask_lens else None
        return visibility(
            ops,
            num_queries,
            num_keys,
            lens,
            causal=self.mask_causal,
            window=options.window if self.mask_window else None,
            query_positions=options.query_positions,
        )

    def fix_visibility(
        self,
        ops: ArrayOps,
        num_queries: Any,
        num_keys: Any,
        valid_lens: Array | None,
        options: ScoreOptions = NO_OPTIONS,
    ) -> Array | None:
        """What :func:`fix_fully_hidden_rows` reads (``None``: no row to fix).

        The causal rule hides whole rows only when ``Q > K`` (in the
        bottom-right frame), so below that the lengths, and the window,
        tell which rows are fully hidden: a query at ``i_abs >= 0`` sees
        key ``i_abs`` through the window and the causal rule alike, so the
        causal rule never empties a row the others leave seen.
        """
        if not self.fix_rows:
            return None
        return visibility(
            ops,
            num_queries,
            num_keys,
            valid_lens,
            causal=self.fix_causal,
            window=options.window if self.fix_window else None,
            query_positions=options.query_positions,
        )


def _generic(reason: str) -> KernelPlan:
    return KernelPlan(fused=False, reason=reason)


def _plan_relations(settings: dict[str, Any]) -> dict[str, Any]:
    """:func:`plan_kernel`'s settings with the sizes and the shortest length as it compares them.

    A plan reads of ``(B, Q, K)`` and ``shortest_length`` only which are 0,
    how ``Q`` compares with ``K``, and whether the shortest length is
    positive and at least ``K``: sizes with the same answers give the same
    plan. (A NaN length, or sizes not known, are kept as they are.)
    """
    sizes = settings["sizes"]
    if not all(type(size) is int for size in sizes):
        return settings
    _, num_queries, num_keys = sizes
    if 0 in sizes:
        return {**settings, "sizes": tuple(min(size, 1) for size in sizes)}
    relation = 1 if num_queries < num_keys else 2 if num_queries == num_keys else 3
    shortest = settings.get("shortest_length")
    if shortest is not None and shortest == shortest:  # not NaN
        shortest = 2 if shortest >= num_keys else 1 if shortest > 0 else 0
    return {**settings, "sizes": (1, relation, 2), "shortest_length": shortest}


#: Scores per head (``Q * K``) from which an eager call on an accelerator reads
#: its projections to the host to choose the fused kernel (:func:`reads_values`).
DEVICE_READ_SCORES = 1 << 16

#: Scores in all (``B * H * Q * K``) from which an eager call on an accelerator
#: that records no gradient reads (:func:`reads_values`).
DEVICE_READ_TOTAL_SCORES = 1 << 26


def reads_values(
    on_host: bool, num_queries: int, num_keys: int, *, total_scores: int | None = None
) -> bool:
    """Whether an eager call reads its projections to plan (``values_exact``,
    one transfer), its arrays on the host (``on_host``) or an accelerator.

    On the host always: nothing waits. On an accelerator the transfer waits
    for every kernel queued before it, so only where a head's scores are
    many (:data:`DEVICE_READ_SCORES`): there the fused kernel saves more than
    that wait costs and never holds the ``(B, H, Q, K)`` scores. A call that
    records no gradient gives its ``total_scores`` (``B * H * Q * K``): its
    generic path holds them only while it runs, and reads only from
    :data:`DEVICE_READ_TOTAL_SCORES`, where the kernel's time saved first
    outweighs the wait. Below it (a decoding step, a short call) nothing is
    read, the generic path runs, and the forward never synchronises (docs:
    "Fast paths", measured on an H100 on the results page).
    """
    if on_host:
        return True
    if num_queries * num_keys < DEVICE_READ_SCORES:
        return False
    return total_scores is None or total_scores >= DEVICE_READ_TOTAL_SCORES


def magnitude_limit(head_dim: int) -> float:
    """The bound on ``max|q| * max|k|`` below which every score lies within
    :data:`FUSED_SCORE_LIMIT`: ``|q . k| / sqrt(head_dim) <= sqrt(head_dim) *
    max|q| * max|k|`` (Cauchy-Schwarz, per element)."""
    return FUSED_SCORE_LIMIT / math.sqrt(head_dim)


def scores_within_limit(query_max: float, key_max: float, head_dim: int) -> bool:
    """Whether every score of queries and keys of these largest magnitudes
    (``max|q|``, ``max|k|``) lies within :data:`FUSED_SCORE_LIMIT`
    (:func:`magnitude_limit`). A NaN magnitude fails."""
    return query_max * key_max < magnitude_limit(head_dim)


@_decided_once(canonical=_plan_relations)
def plan_kernel(
    kernel: FusedKernel,
    *,
    sizes: tuple[Any, Any, Any],
    lens_ndim: int | None,
    lens_integer: bool = True,
    causal: bool = False,
    dropout: bool = False,
    return_attention_weights: bool = False,
    dtype_supported: bool = True,
    values_exact: bool | None = None,
    shortest_length: float | None = None,
    grouped: bool = False,
    grouped_taken: bool = True,
    bias: bool = False,
    softcap: bool = False,
    window: bool = False,
    query_positions: bool = False,
    values_guard: bool = False,
) -> KernelPlan:
    """Whether a call runs ``kernel``, and what the kernel is given.

    One decision for every backend: the fused path runs only where it gives
    the spec's numbers, so it is an optimisation and never a second
    definition (docs: "Fast paths").

    Args:
        kernel: the facts of the backend's kernel.
        sizes: ``(B, Q, K)``; ``None`` (or anything not an int) where unknown.
        lens_ndim: ``None`` without lengths, else 1 or 2.
        lens_integer: whether the lengths are integers.
        causal: the spec's causal flag.
        dropout: whether dropout is active for this call.
        return_attention_weights: whether the call returns the weights.
        dtype_supported: whether the kernel serves this dtype and precision.
        values_exact: what the caller read from the values: ``True`` when
            every projection (and the bias, where there is one) is finite
            (and, where the backend's kernel needs it, bounded), ``False``
            when not, ``None`` when they cannot be read (a traced graph).
        shortest_length: the shortest length, where it was read; ``None``
            where it was not (every row may then be fully hidden).
        grouped: fewer key/value heads than query heads.
        grouped_taken: where the kernel takes grouped heads, whether it is
            to take this call's as they are; ``False`` where the framework
            serves them better repeated (a kernel that would hold every
            score otherwise), so the plan repeats them once.
        bias: the scores get an additive bias (a ``bias`` argument or ALiBi).
        softcap: the scores are soft-capped.
        window: the layer has a sliding window.
        query_positions: the queries sit at their own positions among the
            keys (:attr:`ScoreOptions.query_positions`, a cached call), not
            in the bottom-right frame.
        values_guard: where the values are unreadable (``values_exact is
            None``), the caller can choose between the kernel and the
            generic path on the device, from the values
            (:attr:`KernelPlan.guarded`). Never with dropout: the two paths
            would draw different random numbers.

    Returns:
        The plan.
    """
    if return_attention_weights:
        return _generic("the attention weights are requested")
    if not dtype_supported:
        return _generic("the kernel does not serve this dtype or precision")
    if bias and not kernel.takes_bias:
        return _generic("the kernel takes no additive bias (bias or ALiBi)")
    if softcap and not kernel.takes_softcap:
        return _generic("the kernel has no soft-capping")
    if not all(isinstance(size, int) for size in sizes):
        return _generic("sizes unknown while tracing")
    batch, num_queries, num_keys = sizes
    if batch == 0 or num_queries == 0 or num_keys == 0:
        return _generic("an empty axis")
    guarded = False
    if not kernel.replaces_hidden_scores and values_exact is not True:
        guarded = values_exact is None and values_guard and not dropout
        if not guarded:
            return _generic(
                "non-finite or unbounded values" if values_exact is False else "values unreadable"
            )
    if shortest_length is not None and lens_ndim is not None and shortest_length >= num_keys:
        lens_ndim = None  # lengths that hide nothing need no mask
    lens_may_hide_rows = lens_ndim is not None and not (
        shortest_length is not None and shortest_length > 0  # NaN hides every key
    )
    # Own query positions may lie anywhere: the causal rule may then hide
    # whole rows whatever the sizes.
    causal_hides_rows = causal and (num_queries > num_keys or query_positions)
    # Without lengths a window leaves each query key i_abs (causal) or the
    # keys after it; with lengths, or own positions, it may leave none.
    window_hides_rows = window and (lens_ndim is not None or query_positions)
    fix_rows = (
        lens_may_hide_rows or causal_hides_rows or window_hides_rows
    ) and not kernel.hidden_rows_uniform
    if dropout and not kernel.takes_dropout:
        return _generic("the kernel has no dropout")
    if dropout and fix_rows:
        # A fully hidden row would need dropout on its uniform weights.
        return _generic("dropout with rows that may be fully hidden")
    key_lengths = lens_ndim == 1 and lens_integer and kernel.takes_key_lengths
    mask_lens = lens_ndim is not None and not key_lengths
    # The kernel's own flags are top-left aligned: the spec's frame only when Q == K.
    same_frame = num_queries == num_keys and not query_positions
    window_flag = window and kernel.takes_window and same_frame
    mask_window = window and not window_flag
    is_causal = (
        causal
        and kernel.causal_flag
        and same_frame
        # A bias reaches a kernel beside its mask, where the causal flag may not go.
        and (not (mask_lens or mask_window or bias) or kernel.mask_and_causal)
    )
    return KernelPlan(
        fused=True,
        is_causal=is_causal,
        key_lengths=key_lengths,
        mask_lens=mask_lens,
        mask_causal=causal and not is_causal,
        fix_rows=fix_rows,
        fix_causal=causal_hides_rows,
        repeat_kv=grouped and not (kernel.takes_grouped_heads and grouped_taken),
        bias=bias,
        softcap=softcap,
        window_flag=window_flag,
        mask_window=mask_window,
        fix_window=window and fix_rows,
        guarded=guarded,
    )


def is_low_precision(ops: ArrayOps, dtype: Any) -> bool:
    """Whether ``dtype`` is a 16-bit float (float16, bfloat16)."""
    return ops.dtype_kind(dtype) == "f" and ops.itemsize(dtype) < 4


def masked_softmax(ops: ArrayOps, scores: Array, visible: Array | None, dtype: Any = None) -> Array:
    """Softmax over the last axis with hidden scores replaced by ``MASK_VALUE``.

    Hidden scores are *replaced*, so a NaN or inf score of a hidden key does
    not reach the weights.

    Args:
        scores: ``(B, H, Q, K)``.
        visible: ``None`` or a boolean array broadcastable to ``scores``.
        dtype: the dtype of the weights; ``None`` keeps that of ``scores``.

    Returns:
        Weights of ``dtype``. 16-bit scores are softmaxed in float32
        (``-1e6`` overflows float16) and the weights rounded once.
    """
    dtype = ops.dtype(scores) if dtype is None else dtype
    if is_low_precision(ops, ops.dtype(scores)):
        scores = ops.cast(scores, ops.float32())
    if visible is not None:
        scores = ops.where(visible, scores, MASK_VALUE)
    weights = ops.softmax(scores)
    return weights if ops.dtype(weights) == dtype else ops.cast(weights, dtype)


def fix_fully_hidden_rows(
    ops: ArrayOps,
    output: Array,
    values: Array,
    visible: Array | None,
    *,
    heads_axis: int,
    group_size: int = 1,
) -> Array:
    """Gives a fused kernel's fully hidden rows the spec's value.

    Fused kernels mask with ``-inf`` and return 0 (or NaN) for a query that
    sees no key. The spec replaces hidden scores by ``MASK_VALUE``, so such a
    row has uniform weights ``1/K`` and its output is the mean of all value
    rows; its gradient flows to every value row and to no query or key, which
    selecting the mean reproduces. Rows with a visible key are untouched.

    Args:
        ops: the array-ops adapter.
        output: per-head output, ``(B, H, Q, dh)`` when ``heads_axis == 1`` or
            ``(B, Q, H, dh)`` when ``heads_axis == 2``.
        values: per-head values in the same layout, ``K`` in place of ``Q``.
        visible: what :func:`visibility` returned for these shapes.
        heads_axis: where the heads axis is, 1 or 2.
        group_size: query heads per key/value head (grouped-query
            attention): ``values`` then has ``H / group_size`` heads, and a
            fully hidden row of query head ``h`` is the mean of key/value
            head ``h // group_size``, broadcast over its group (no value is
            repeated).

    Returns:
        ``output`` with fully hidden rows replaced.
    """
    if visible is None:
        return output
    hidden = ops.logical_not(ops.any_last(visible))  # (B, 1, Q|1, 1) or (Q, 1)
    if heads_axis == 2:
        if ops.ndim(hidden) == 4:
            hidden = ops.permute(hidden, (0, 2, 1, 3))  # (B, Q|1, 1, 1)
        else:
            hidden = ops.expand_dims(hidden, -1)  # (Q, 1, 1)
        keys_axis = 1
    elif heads_axis == 1:
        keys_axis = 2
    else:
        raise ValueError(f"heads_axis must be 1 or 2; got {heads_axis}")
    means = ops.mean(values, keys_axis)
    if group_size == 1:
        return ops.where(hidden, means, output)
    # Heads axis h -> (h // G, h % G): a group axis of size G for the means
    # and the hidden rows to broadcast over.
    grouped = ops.split_axis(output, heads_axis, (-1, group_size))
    means = ops.expand_dims(means, heads_axis + 1)
    if ops.ndim(hidden) == 4 or heads_axis == 2:
        hidden = ops.expand_dims(hidden, heads_axis + 1)
    return ops.merge_axes(ops.where(hidden, means, grouped), heads_axis)


def scaled_scores(ops: ArrayOps, q: Array, k: Array, head_dim: int) -> Array:
    """``(q @ k^T) / sqrt(head_dim)`` for ``(B*H, T, dh)`` heads (d2l's order).

    16-bit heads give float32 scores: the products of two 16-bit numbers are
    exact in float32 and the sum is accumulated there, so the scores of
    inputs of magnitude 300 (about 1e5) cannot overflow float16 on their way
    into the float32 softmax.
    """
    if is_low_precision(ops, ops.dtype(q)):
        q, k = ops.cast(q, ops.float32()), ops.cast(k, ops.float32())
    return ops.matmul(q, ops.swap_last(k)) / math.sqrt(head_dim)


def attention(
    ops: ArrayOps,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Array | None,
    *,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    dropout: Callable[[Array], Array] | None = None,
    kv_split: bool = False,
    options: ScoreOptions = NO_OPTIONS,
) -> tuple[Array, Array]:
    """Multi-head scaled dot-product attention on projected inputs.

    Args:
        ops: the array-ops adapter.
        q: projected queries ``(B, Q, num_heads * head_dim)``.
        k: projected keys ``(B, K, num_kv_heads * head_dim)``.
        v: projected values ``(B, K, num_kv_heads * head_dim)``.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``.
        num_heads: ``H``, the query heads.
        head_dim: the size of each head (static, so that symbolic graphs
            need no shapes); scores are scaled by ``1/sqrt(head_dim)``.
        num_kv_heads: the key/value heads (``None``: ``num_heads``); query
            head ``h`` reads key/value head ``h // (num_heads // num_kv_heads)``.
        causal: bottom-right aligned causal mask, combined with ``valid_lens``.
        dropout: applied to the attention weights (training), or ``None``.
        kv_split: ``k`` and ``v`` are already split into heads,
            ``(B, num_kv_heads, K, head_dim)``, as a :class:`KVCache` holds
            them.
        options: soft-capping, bias, ALiBi and the sliding window
            (:func:`adjust_scores`, :func:`visibility`); rotary embeddings
            are applied to ``q`` and ``k`` before (:func:`rotate`).

    Returns:
        ``(context, weights)``: the concatenated heads ``(B, Q, num_heads *
        head_dim)`` before the output projection, and the pre-dropout
        attention weights ``(B, H, Q, K)``.
    """
    if num_kv_heads is not None and num_kv_heads != num_heads:
        return _grouped_attention(
            ops,
            q,
            k,
            v,
            valid_lens,
            num_heads,
            num_kv_heads,
            head_dim,
            causal,
            dropout,
            kv_split,
            options,
        )
    q = transpose_qkv(ops, q, num_heads)
    k, v = (_kv_heads(ops, x, num_heads, kv_split) for x in (k, v))
    head_scores = scaled_scores(ops, q, k, head_dim)  # (B*H, Q, K)
    # Rows are b*H + h, so splitting axis 0 as (B, H) lines heads up with a
    # (B, 1, ...) mask: valid_lens repeated interleaved, never tiled.
    scores = ops.split_axis(head_scores, 0, (-1, num_heads))  # (B, H, Q, K)
    weights = _option_weights(ops, scores, valid_lens, causal, options, ops.dtype(v))
    flat_weights = ops.merge_axes(weights, 0)
    if dropout is not None:
        flat_weights = dropout(flat_weights)
    context = transpose_output(ops, ops.matmul(flat_weights, v), num_heads)
    return context, weights


def attention_by_kv_heads(
    ops: ArrayOps,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Array | None,
    *,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    causal: bool = False,
    kv_split: bool = False,
    vmap: Callable[..., Callable[..., Any]],
) -> tuple[Array, Array]:
    """:func:`attention` mapped over the examples and the key/value heads.

    d2l's layout merges examples and heads into one axis ``(B*H, T, dh)``,
    which a partitioner cannot split by heads: with the heads sharded over
    devices, XLA gathers the projections and every device computes every
    head. Here each example's key/value head ``j`` meets its group of query
    heads ``[j G, (j + 1) G)`` (columns ``[j G dh, (j + 1) G dh)`` of ``q``)
    in one mapped call of :func:`attention`, so the heads stay an axis of
    their own and each device attends with its own (docs: "Sharding heads").
    Every score is the same dot product: the numbers are :func:`attention`'s.
    No dropout: a mapped dropout would draw the same mask for every head.

    Args:
        ops: the array-ops adapter.
        q: projected queries ``(B, Q, num_heads * head_dim)``.
        k: projected keys ``(B, K, num_kv_heads * head_dim)``, or with
            ``kv_split`` a cache's ``(B, num_kv_heads, M, head_dim)``;
            ``v`` likewise.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``.
        num_heads, head_dim, num_kv_heads, causal: as in :func:`attention`.
        kv_split: as in :func:`attention`.
        vmap: ``jax.vmap``, or a function of its signature for the
            adapter's arrays (``in_axes``, ``out_axes``).

    Returns:
        ``(context, weights)``: ``(B, Q, num_heads * head_dim)`` and
        ``(B, H, Q, K)``, as :func:`attention` returns them.
    """
    group_size = num_heads // num_kv_heads
    q = ops.split_axis(q, 2, (num_kv_heads, group_size * head_dim))  # (B, Q, H_kv, G*dh)
    if kv_split:
        kv_axis = 0  # an example's (H_kv, M, dh)
    else:
        k, v = (ops.split_axis(x, 2, (num_kv_heads, head_dim)) for x in (k, v))
        kv_axis = 1  # an example's (K, H_kv, dh)

    def one_group(q: Array, k: Array, v: Array, lens: Array | None) -> tuple[Array, Array]:
        # One example (a batch of 1) and one key/value head: multi-head attention.
        context, weights = attention(
            ops,
            ops.expand_dims(q, 0),
            ops.expand_dims(k, 0),
            ops.expand_dims(v, 0),
            None if lens is None else ops.expand_dims(lens, 0),
            num_heads=group_size,
            head_dim=head_dim,
            num_kv_heads=1,
            causal=causal,
        )
        return ops.merge_axes(context, 0), ops.merge_axes(weights, 0)

    per_group = vmap(one_group, in_axes=(1, kv_axis, kv_axis, None), out_axes=(1, 0))
    lens_axis = None if valid_lens is None else 0
    per_example = vmap(per_group, in_axes=(0, 0, 0, lens_axis), out_axes=(0, 0))
    context, weights = per_example(q, k, v, valid_lens)  # (B, Q, H_kv, G*dh), (B, H_kv, G, Q, K)
    return ops.merge_axes(context, 2), ops.merge_axes(weights, 1)


def _grouped_attention(
    ops: ArrayOps,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Array | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: bool,
    dropout: Callable[[Array], Array] | None,
    kv_split: bool,
    options: ScoreOptions,
) -> tuple[Array, Array]:
    """:func:`attention` with ``num_kv_heads < num_heads``, no key or value repeated.

    Each key/value head meets its group of query heads in one product
    (:func:`transpose_grouped_queries`); every score is the same dot product
    as with the key/value heads repeated, so the numbers are those of
    multi-head attention on repeated heads.
    """
    group_size = num_heads // num_kv_heads
    q = transpose_grouped_queries(ops, q, num_kv_heads, group_size)  # (B*H_kv, G*Q, dh)
    k, v = (_kv_heads(ops, x, num_kv_heads, kv_split) for x in (k, v))  # (B*H_kv, K, dh)
    scores = grouped_to_heads(
        ops, scaled_scores(ops, q, k, head_dim), num_kv_heads, group_size
    )  # (B, H, Q, K)
    weights = _option_weights(ops, scores, valid_lens, causal, options, ops.dtype(v))
    flat_weights = heads_to_grouped(ops, weights, num_kv_heads, group_size)
    if dropout is not None:
        flat_weights = dropout(flat_weights)
    context = ops.matmul(flat_weights, v)  # (B*H_kv, G*Q, dh)
    return transpose_grouped_output(ops, context, num_kv_heads, group_size), weights


def _option_weights(
    ops: ArrayOps,
    scores: Array,
    valid_lens: Array | None,
    causal: bool,
    options: ScoreOptions,
    dtype: Any,
) -> Array:
    """The weights of ``(B, H, Q, K)`` scaled scores: options, masks, softmax.

    Both layouts of :func:`attention` reach the heads' scores as ``(B, H,
    Q, K)``, so each option is applied here once.
    """
    if options.adjusts_scores:
        scores = adjust_scores(ops, scores, options)
    visible = visibility(
        ops,
        ops.size(scores, 2),
        ops.size(scores, 3),
        valid_lens,
        causal=causal,
        window=options.window,
        query_positions=options.query_positions,
    )
    return masked_softmax(ops, scores, visible, dtype)


def _kv_heads(ops: ArrayOps, x: Array, num_kv_heads: int, split: bool) -> Array:
    """Keys or values as ``(B*H_kv, K, dh)``; ``split``: from ``(B, H_kv, K, dh)``."""
    return ops.merge_axes(x, 0) if split else transpose_qkv(ops, x, num_kv_heads)


def check_head_mask(
    head_mask_shape: Sequence[int], head_mask_kind: str, *, num_heads: int, batch: int
) -> None:
    """Validates a ``head_mask``: ``(num_heads,)`` or ``(batch, num_heads)``, floating.

    Raises:
        TypeError: ``head_mask`` is not floating-point (numpy dtype kind ``head_mask_kind``).
        ValueError: another shape.
    """
    if head_mask_kind != "f":
        raise TypeError(
            f"head_mask must be a floating-point array; got dtype kind {head_mask_kind!r}"
        )
    shape = tuple(head_mask_shape)
    if not _one_of(shape, (num_heads,), (batch, num_heads)):
        raise ValueError(
            f"head_mask must have shape (num_heads,) = ({num_heads},) or (batch, num_heads) = "
            f"({batch}, {num_heads}); got {shape}"
        )


def apply_head_mask(
    ops: ArrayOps, context: Array, head_mask: Array | None, num_heads: int
) -> Array:
    """Multiplies head ``h``'s context by ``head_mask[..., h]`` (docs: "Heads").

    The gate of Michel, Levy & Neubig (2019): the heads' concatenated context
    ``(B, Q, num_heads * head_dim)``, before ``W_o``, times ``(num_heads,)``
    or ``(B, num_heads)`` gates; a gate of 0 removes the head, and the
    gradient with respect to the gates measures each head's importance.
    """
    if head_mask is None:
        return context
    heads = ops.split_axis(context, 2, (num_heads, -1))  # (B, Q, H, dh)
    gates = ops.expand_dims(ops.cast(head_mask, ops.dtype(context)), -1)  # (1|B, H, 1)
    if ops.ndim(head_mask) == 2:
        gates = ops.expand_dims(gates, 1)  # (B, 1, H, 1)
    return ops.merge_axes(heads * gates, 2)


# --------------------------------------------------------------------------
# Incremental decoding with a key/value cache (docs: "Generating with a cache")
# --------------------------------------------------------------------------


class KVCache(NamedTuple):
    """The projected keys and values a layer has seen, per example.

    A named tuple of the backend's arrays, so it passes through ``jax.jit``
    (a pytree), ``torch.compile`` and ``tf.function`` as it is: ``keys`` and
    ``values`` are the projected keys and values ``(B, num_kv_heads,
    max_length, head_dim)``, ``lengths`` ``(B,)`` int32 the positions each
    example holds (positions from ``lengths[b]`` on are free and hold nothing
    meaningful).
    """

    keys: Any
    values: Any
    lengths: Any


def cache_shape(batch_size: Any, max_length: Any, heads: Heads) -> tuple[int, int, int, int]:
    """The shape of a cache's keys and values, ``(B, num_kv_heads, max_length, head_dim)``.

    Raises:
        TypeError: ``batch_size`` or ``max_length`` is not an int.
        ValueError: either is negative.
    """
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be a non-negative int; got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be a non-negative int; got {value}")
    return (int(batch_size), heads.num_kv_heads, int(max_length), heads.head_dim)


@_decided_once
def check_cached_inputs(
    queries_shape: Sequence[int],
    keys_shape: Sequence[int] | None,
    values_shape: Sequence[int] | None,
    valid_lens_shape: Sequence[int] | None,
    cache_shapes: KVCache,
    *,
    heads: Heads,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
    causal: Any = False,
) -> None:
    """Validates the shapes of a cached call (docs: "Generating with a cache").

    Args:
        queries_shape: ``(B, T, query_size)``: ``T`` new positions.
        keys_shape: ``(B, T, key_size)``, or ``None`` (then ``values_shape``
            is ``None`` too) to attend to the cache without appending.
        values_shape: ``(B, T, value_size)`` or ``None``.
        valid_lens_shape: ``None`` or ``(B,)``: the real new positions of
            each example.
        cache_shapes: the shapes of the cache's ``keys``, ``values`` and
            ``lengths``.
        heads: the layer's head layout.
        query_size, key_size, value_size: the layer's input sizes, or
            ``None`` where not yet known.
        causal: the call's ``causal`` flag.

    Raises:
        ValueError: naming the offending argument and the expected shape.
        TypeError: ``causal`` is not a bool.
    """
    queries_shape = tuple(queries_shape)
    if (keys_shape is None) != (values_shape is None):
        raise ValueError(
            "keys and values must both be given (new positions to append) or both be "
            "None (attend to the cache as it is)"
        )
    if keys_shape is None:
        check_causal(causal)
        if len(queries_shape) != 3:
            raise ValueError(
                f"queries must be 3-D (batch, length, features); got shape {queries_shape}"
            )
        if query_size is not None and queries_shape[2] != query_size:
            raise ValueError(
                f"queries last dimension must be query_size={query_size}; got shape {queries_shape}"
            )
        if valid_lens_shape is not None:
            raise ValueError(
                "valid_lens counts new positions, and a call without keys and values appends "
                "none: pass valid_lens=None"
            )
    else:
        check_inputs(
            queries_shape,
            keys_shape,
            values_shape,
            valid_lens_shape,
            query_size=query_size,
            key_size=key_size,
            value_size=value_size,
            causal=causal,
        )
        if tuple(keys_shape)[1] != queries_shape[1]:
            raise ValueError(
                f"keys and values of a cached call are the queries' new positions and must "
                f"have their length {queries_shape[1]}; got {tuple(keys_shape)[1]}"
            )
        if valid_lens_shape is not None and len(tuple(valid_lens_shape)) != 1:
            raise ValueError(
                f"valid_lens of a cached call must have shape (batch,) = ({queries_shape[0]},): "
                f"the number of new positions of each example; got {tuple(valid_lens_shape)}"
            )
    batch = queries_shape[0]
    keys, values, lengths = (tuple(shape) for shape in cache_shapes)
    expected = (batch, heads.num_kv_heads, "max_length", heads.head_dim)
    for name, shape in (("cache.keys", keys), ("cache.values", values)):
        if len(shape) != 4 or shape[:2] != expected[:2] or shape[3] != heads.head_dim:
            raise ValueError(
                f"{name} must have shape (batch, num_kv_heads, max_length, head_dim) = "
                f"({batch}, {heads.num_kv_heads}, max_length, {heads.head_dim}); got {shape}"
            )
    if values != keys:
        raise ValueError(f"cache.values must have the shape of cache.keys {keys}; got {values}")
    if lengths != (batch,):
        raise ValueError(f"cache.lengths must have shape (batch,) = ({batch},); got {lengths}")


def check_cache_dtypes(lengths_kind: str, valid_lens_kind: str | None) -> None:
    """Raises ``TypeError`` unless the cache's lengths and the new lengths are integers.

    Args:
        lengths_kind: numpy dtype kind of ``cache.lengths``.
        valid_lens_kind: numpy dtype kind of the call's ``valid_lens``, or
            ``None`` without them.
    """
    if lengths_kind not in "iu":
        raise TypeError(f"cache.lengths must be integers; got dtype kind {lengths_kind!r}")
    if valid_lens_kind is not None and valid_lens_kind not in "iu":
        raise TypeError(
            "valid_lens of a cached call counts new positions and must be integers; "
            f"got dtype kind {valid_lens_kind!r}"
        )


def check_cached_call(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any,
    cache: KVCache,
    *,
    heads: Heads,
    dtype_kind: Callable[[Any], str],
    causal: Any = False,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
) -> None:
    """Every check of a cached call that reads no values: shapes, then dtypes.

    :func:`check_cached_inputs` on the arrays' shapes and
    :func:`check_cache_dtypes` on their dtypes, for any framework's arrays
    (each has ``.shape`` and ``.dtype``); ``dtype_kind`` maps the framework's
    dtypes to numpy kinds (``"f"``, ``"i"``...).
    """

    def shape(x: Any) -> tuple[int, ...] | None:
        return None if x is None else tuple(x.shape)

    check_cached_inputs(
        shape(queries),  # type: ignore[arg-type]
        shape(keys),
        shape(values),
        shape(valid_lens),
        KVCache(*(shape(x) for x in cache)),
        heads=heads,
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
        causal=causal,
    )
    check_cache_dtypes(
        dtype_kind(cache.lengths.dtype),
        None if valid_lens is None else dtype_kind(valid_lens.dtype),
    )


#: An eager cached call attends over a multiple of this many cache positions
#: (docs: "Generating with a cache"): few distinct shapes, little wasted work.
SPAN_BUCKET = 64


class CacheFill(NamedTuple):
    """A cached call's lengths as an eager call reads them (:func:`check_cache_values`).

    ``lengths`` is ``cache.lengths`` before the call and ``new`` the
    positions each example appends, both numpy ``(B,)`` int64; ``held`` is
    their sum, what each example holds after the call, and ``least`` and
    ``most`` its smallest and largest entries (0 for an empty batch).
    """

    lengths: np.ndarray
    new: np.ndarray
    held: np.ndarray
    least: int
    most: int

    def visibility(self, num_new: int, *, causal: bool) -> np.ndarray:
        """:func:`cached_visibility` computed on the host: ``(B,)``, or ``(B, T)`` when causal.

        A causal call of one new position is ``(B,)`` too: its one query
        sees its own key and all before it, as without the causal rule.
        """
        if num_new == 1:
            causal = False
        return cached_visibility(NumpyOps(), self.lengths, self.new, num_new, causal=causal)

    def uniform_start(self, num_new: int) -> int | None:
        """The position every example writes its ``num_new`` rows from, where they share one.

        ``None`` where the examples hold different lengths or append
        different counts (a ragged batch).
        """
        starts, counts = set(self.lengths.tolist()), set(self.new.tolist())
        if len(starts) != 1 or counts != {num_new}:
            return None
        return starts.pop()

    def span(
        self,
        num_queries: int,
        max_length: int,
        *,
        window: int | None = None,
        bucket: int = SPAN_BUCKET,
    ) -> int:
        """How many leading cache positions the call must attend over for the spec's numbers.

        Keys from ``lengths[b] + new[b]`` on are hidden from every query of
        example ``b``, and a hidden score (-1e6) adds exactly nothing to a
        softmax whose row has a visible score: attending over the filled
        positions, rounded up to ``bucket``, gives the numbers of all
        ``max_length``, where the values past them are finite (a hidden
        value's weight is 0, which a NaN or an infinity makes NaN: the
        caller checks, :func:`mha_multi.call.attended_positions`). A fully
        hidden row is the exception (uniform over all ``max_length`` keys):
        an example that holds nothing, or, with a ``window``, a padding query
        further than the window past its example's last key. Then the whole
        cache is attended over.

        Args:
            num_queries: ``T``, the call's new positions.
            max_length: the cache's capacity.
            window: the layer's window, or ``None``.
            bucket: the span is a multiple of it (or ``max_length``).
        """
        if self.held.size == 0 or self.least <= 0:
            return max_length
        if window is not None and num_queries - int(self.new.min()) >= window:
            return max_length
        return rounded_span(self.most, max_length, bucket)


def rounded_span(filled: int, max_length: int, bucket: int) -> int:
    """``filled`` leading cache positions rounded up to a multiple of ``bucket``, at most
    ``max_length``: the span a call attends over (:meth:`CacheFill.span`)."""
    return min(max_length, -(-filled // bucket) * bucket)


def check_cache_values(lengths: Any, valid_lens: Any, num_new: int, max_length: int) -> CacheFill:
    """Validates a cached call's lengths where they can be read (eager mode).

    Args:
        lengths: ``cache.lengths`` as numpy, ``(B,)``.
        valid_lens: the call's new positions per example as numpy ``(B,)``,
            or ``None`` (every example appends ``num_new``; ``0`` for a call
            without keys and values).
        num_new: ``T``, the new positions of the call.
        max_length: the cache's capacity.

    Returns:
        The lengths read, for :meth:`CacheFill.span` and in-place writes.

    Raises:
        ValueError: a negative length, a new length outside ``[0, T]``, or an
            example that would hold more than ``max_length`` positions.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"cache.lengths must be >= 0; got {lengths.tolist()}")
    if valid_lens is None:
        new = np.full_like(lengths, num_new)
    else:
        new = np.asarray(valid_lens, dtype=np.int64)
        if new.size and (new.min() < 0 or new.max() > num_new):
            raise ValueError(
                f"valid_lens of a cached call must be in [0, {num_new}] (the new positions of "
                f"each example); got {new.tolist()}"
            )
    held = lengths + new
    least, most = (int(held.min()), int(held.max())) if held.size else (0, 0)
    if most > max_length:
        b = int(held.argmax())
        raise ValueError(
            f"the cache overflows: example {b} would hold {int(held[b])} positions "
            f"(cache.lengths {int(lengths[b])} + {int(new[b])} new); max_length is {max_length}"
        )
    return CacheFill(lengths, new, held, least, most)


def update_cache(
    ops: ArrayOps,
    cache: KVCache,
    k: Array | None,
    v: Array | None,
    valid_lens: Array | None,
    *,
    head_dim: int,
    causal: bool,
) -> tuple[KVCache, Array]:
    """Writes a call's new keys and values into the cache, and says what each query sees.

    Example ``b`` holds ``lengths[b]`` positions and appends ``n_b =
    valid_lens[b]`` (all ``T`` by default) at positions ``lengths[b] ..
    lengths[b] + n_b - 1``; padding past ``n_b`` is not kept. Query ``i``
    (absolute position ``lengths[b] + i``) sees key ``j`` iff ``j <
    lengths[b] + n_b`` and, when causal, ``j <= lengths[b] + i``: the causal
    rule aligned bottom-right for each example on its own.

    Positions at or past ``max_length`` are never written, and no position
    below ``lengths[b]`` is overwritten, whatever the lengths: where an
    eager caller would have raised (:func:`check_cache_values`), compiled
    code drops the positions that do not fit, and ``lengths`` still counts
    them, so ``lengths > max_length`` tells that it happened.

    Args:
        ops: the array-ops adapter.
        cache: the cache before the call.
        k: projected new keys ``(B, T, num_kv_heads * head_dim)``, or
            ``None`` to append nothing.
        v: projected new values, likewise.
        valid_lens: ``(B,)`` integer new positions per example, or ``None``.
            Backends whose sizes are not ints (MXNet symbols) pass them.
        head_dim: the size of each head.
        causal: the call's causal flag.

    Returns:
        ``(cache, lens)``: the cache after the call, and the lengths for
        :func:`visibility` over its ``max_length`` keys: ``(B, T)`` when
        causal, else ``(B,)``.
    """
    lengths = cache.lengths
    if k is None:
        return cache, lengths
    num_new = ops.size(k, 1)
    if isinstance(num_new, int) and num_new == 0:
        return cache, lengths  # no position to write, and no query
    check_cache_dtype(ops, cache, ops.dtype(k), ops.dtype(v))
    new = appended(ops, lengths, valid_lens, num_new)
    positions = ops.arange(ops.size(cache.keys, 2))  # (M,)
    start = ops.expand_dims(lengths, 1)  # (B, 1)
    offsets = ops.expand_dims(positions, 0) - start  # (B, M): p - lengths[b]
    written = ops.logical_and(
        ops.greater_equal(offsets, offsets * 0), ops.less(offsets, ops.expand_dims(new, 1))
    )
    source = ops.where(written, offsets, offsets * 0)  # any position in range where unwritten
    written = ops.expand_dims(ops.expand_dims(written, 1), -1)  # (B, 1, M, 1)

    def write(x: Array, held: Array) -> Array:
        rows = ops.gather_positions(x, source)  # (B, M, H_kv*dh)
        rows = ops.permute(ops.split_axis(rows, 2, (-1, head_dim)), (0, 2, 1, 3))
        return ops.where(written, rows, held)

    updated = KVCache(write(k, cache.keys), write(v, cache.values), lengths + new)
    return updated, cached_visibility(ops, lengths, new, num_new, causal=causal)


def check_cache_dtype(ops: ArrayOps, cache: KVCache, keys_dtype: Any, values_dtype: Any) -> None:
    """The cache holds the projections' dtypes (a ``TypeError`` naming the cache's array if not)."""
    for name, dtype in (("keys", keys_dtype), ("values", values_dtype)):
        held = ops.dtype(getattr(cache, name))
        if held != dtype:
            raise TypeError(
                f"cache.{name} dtype {held} differs from the layer's projected {name} "
                f"dtype {dtype}; make the cache with layer.init_cache"
            )


def appended(ops: ArrayOps, lengths: Array, valid_lens: Array | None, num_new: Any) -> Array:
    """``(B,)`` the positions each example appends: ``valid_lens`` (all ``T`` when ``None``).

    Unchecked (compiled) lengths are clipped into ``[0, T]``, the call's positions.
    """
    if valid_lens is None:
        return lengths * 0 + num_new
    new = ops.cast(valid_lens, ops.dtype(lengths))
    if isinstance(num_new, int):
        new = ops.where(ops.less(new, num_new), new, num_new)
        new = ops.where(ops.less(new, 0), new * 0, new)
    return new


def cached_visibility(
    ops: ArrayOps, lengths: Array, new: Array, num_new: Any, *, causal: bool
) -> Array:
    """What each query of a cached call sees: lengths for :func:`visibility`.

    Args:
        lengths: ``(B,)`` the cache's lengths before the call.
        new: ``(B,)`` the positions each example appends (:func:`appended`).
        num_new: ``T``.
        causal: the call's causal flag.

    Returns:
        ``lengths + new`` ``(B,)``, or when causal ``(B, T)``: query ``i``
        sees ``lengths[b] + min(new[b], i + 1)`` keys.
    """
    if not causal:
        return lengths + new
    seen = ops.expand_dims(ops.arange(num_new), 0) + 1  # (1, T)
    new_column = ops.expand_dims(new, 1)  # (B, 1)
    own = ops.where(ops.less(seen, new_column), seen, new_column)  # (B, T)
    return ops.expand_dims(lengths, 1) + own


# --------------------------------------------------------------------------
# The float64 reference
# --------------------------------------------------------------------------


def _linear(x: np.ndarray, weights: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    y = x @ weights[f"W_{name}"]
    bias = weights.get(f"b_{name}")
    return y if bias is None else y + bias


def _as_float64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _reference_inputs(
    weights: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any,
    num_heads: int,
    num_kv_heads: int | None,
    causal: Any,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, Heads]:
    """Float64 copies of the reference's arguments, checked; and the head layout."""
    w = {name: _as_float64(value) for name, value in weights.items()}
    queries, keys, values = (_as_float64(x) for x in (queries, keys, values))
    lens = None if valid_lens is None else np.asarray(valid_lens)
    check_inputs(
        queries.shape,
        keys.shape,
        values.shape,
        None if lens is None else lens.shape,
        query_size=w["W_q"].shape[0],
        key_size=w["W_k"].shape[0],
        value_size=w["W_v"].shape[0],
        causal=causal,
    )
    heads = heads_of_weights(w, num_heads, num_kv_heads=num_kv_heads)
    return w, queries, keys, values, lens, heads


def heads_of_weights(
    weights: Mapping[str, Any], num_heads: int, *, num_kv_heads: int | None = None
) -> Heads:
    """The head layout canonical weights describe for ``num_heads`` query heads.

    ``head_dim`` is ``W_q``'s width over ``num_heads``; ``num_kv_heads``, when
    not given, is ``W_k``'s width over ``head_dim``.

    Raises:
        ValueError: widths that no head layout of ``num_heads`` heads explains.
    """
    query_features = np.shape(weights["W_q"])[1]
    kv_features = np.shape(weights["W_k"])[1]
    _check_positive_int("num_heads", num_heads)
    if query_features % num_heads:
        raise ValueError(
            f"W_q has {query_features} columns, which num_heads ({num_heads}) does not divide"
        )
    head_dim = query_features // num_heads
    if num_kv_heads is None:
        if kv_features % head_dim:
            raise ValueError(
                f"W_k has {kv_features} columns, not a multiple of head_dim ({head_dim})"
            )
        num_kv_heads = kv_features // head_dim
    heads = check_heads(
        np.shape(weights["W_o"])[1], num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    if kv_features != heads.kv_features:
        raise ValueError(
            f"W_k must have num_kv_heads * head_dim = {heads.kv_features} columns; "
            f"got {kv_features}"
        )
    return heads


def _reference_positions(
    positions: Any, batch: int, num_queries: int, num_keys: int | None
) -> np.ndarray | None:
    """A call's ``positions`` as int64 numpy, checked (:func:`check_positions`)."""
    if positions is None:
        return None
    array = np.asarray(positions)
    check_positions(
        array.shape, array.dtype.kind, batch=batch, num_queries=num_queries, num_keys=num_keys
    )
    return array.astype(np.int64)


def _reference_bias(
    bias: Any, heads: Heads, batch: int, num_queries: int, num_keys: int
) -> np.ndarray | None:
    """A call's ``bias`` as float64 numpy, checked (:func:`check_bias`)."""
    if bias is None:
        return None
    array = np.asarray(bias)
    check_bias(
        array.shape,
        array.dtype.kind,
        batch=batch,
        num_heads=heads.num_heads,
        num_queries=num_queries,
        num_keys=num_keys,
    )
    return array.astype(np.float64)


def _reference_projections(
    w: Mapping[str, np.ndarray],
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    heads: Heads,
    rotary: Rotary | None,
    positions: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """The projected ``q``, ``k``, ``v`` of an uncached call, ``q`` and ``k`` rotated."""
    projected = {"q": _linear(queries, w, "q"), "k": _linear(keys, w, "k")}
    projected["v"] = _linear(values, w, "v")
    if rotary is not None:
        ops = NumpyOps()
        query_positions, key_positions = call_positions(
            ops, positions, num_queries=queries.shape[1], num_keys=keys.shape[1]
        )
        projected["q"] = rotate(
            ops, projected["q"], query_positions, rotary, heads.num_heads, heads.head_dim
        )
        projected["k"] = rotate(
            ops, projected["k"], key_positions, rotary, heads.num_kv_heads, heads.head_dim
        )
    return projected


def reference_forward(
    weights: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    head_mask: Any = None,
    positions: Any = None,
    bias: Any = None,
    **options: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """The spec evaluated in float64 numpy.

    Args:
        weights: canonical weights (``W_q``... in ``x @ W + b`` orientation).
        queries: ``(B, Q, query_size)``.
        keys: ``(B, K, key_size)``.
        values: ``(B, K, value_size)``.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``.
        num_heads: number of (query) heads; ``head_dim`` is ``W_q``'s width
            over it.
        num_kv_heads: number of key/value heads; ``None`` infers it from
            ``W_k``'s width (``num_heads`` for multi-head attention).
        causal: bottom-right aligned causal mask.
        head_mask: ``None``, ``(H,)`` or ``(B, H)`` gates of the heads'
            context (:func:`apply_head_mask`).
        positions: ``None`` or integer ``(B, Q)``: the rotary positions of
            the queries and (``K == Q``) the keys; ``None`` for ``arange``.
        bias: ``None``, or floating, broadcastable to ``(B, H, Q, K)``.
        **options: the layer's options, ``rotary``, ``alibi``, ``window``
            and ``softcap`` (:class:`LayerOptions`).

    Returns:
        ``(output, attention_weights)``: ``(B, Q, num_hiddens)`` and
        ``(B, H, Q, K)``, float64.

    Raises:
        TypeError, ValueError: a bad argument, named.
    """
    layer = LayerOptions.of(options)
    w, queries, keys, values, lens, heads = _reference_inputs(
        weights, queries, keys, values, valid_lens, num_heads, num_kv_heads, causal
    )
    batch, num_queries = queries.shape[:2]
    num_keys = keys.shape[1]
    gates = _reference_head_mask(head_mask, heads, batch)
    positions = _reference_positions(positions, batch, num_queries, num_keys)
    bias = _reference_bias(bias, heads, batch, num_queries, num_keys)
    # Non-finite inputs propagate by design (docs: "Edge cases"); numpy's warnings
    # about them would only be noise.
    with np.errstate(invalid="ignore", over="ignore"):
        projected = _reference_projections(w, queries, keys, values, heads, layer.rotary, positions)
        context, attention_weights = attention(
            NumpyOps(),
            projected["q"],
            projected["k"],
            projected["v"],
            lens,
            num_heads=heads.num_heads,
            head_dim=heads.head_dim,
            num_kv_heads=heads.num_kv_heads,
            causal=causal,
            options=layer.score_options(num_heads=heads.num_heads, bias=bias),
        )
        context = apply_head_mask(NumpyOps(), context, gates, heads.num_heads)
        return _linear(context, w, "o"), attention_weights


def _reference_head_mask(head_mask: Any, heads: Heads, batch: int) -> np.ndarray | None:
    if head_mask is None:
        return None
    gates = np.asarray(head_mask)
    check_head_mask(gates.shape, gates.dtype.kind, num_heads=heads.num_heads, batch=batch)
    return gates.astype(np.float64)


def _sum_to_shape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The gradient of a broadcast: ``x`` summed over the axes ``shape`` was broadcast along."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    axes = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def reference_gradients(
    weights: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    output_gradient: Any,
    head_mask: Any = None,
    positions: Any = None,
    bias: Any = None,
    **options: Any,
) -> dict[str, np.ndarray]:
    """Float64 vector-Jacobian product of :func:`reference_forward`.

    The backward pass is derived by hand (no autodiff framework), so it is an
    independent check of every backend's gradients. Hidden scores are
    replaced by a constant, so they receive no gradient (nor does the bias
    there). A rotation's transpose is the rotation by the opposite angles;
    soft-capping's derivative is ``1 - tanh(s / c) ** 2``.

    Args:
        weights, queries, keys, values, valid_lens, num_heads, num_kv_heads, causal: as in
            :func:`reference_forward`.
        output_gradient: the cotangent of the output, ``(B, Q, num_hiddens)``.
        head_mask: as in :func:`reference_forward`; its gradient is returned
            too.
        positions, bias: as in :func:`reference_forward`; the gradient of
            ``bias`` is returned too, in its shape.
        **options: as in :func:`reference_forward`.

    Returns:
        Gradients keyed ``queries``, ``keys``, ``values``, every weight name
        and, with a ``head_mask``, ``head_mask``, with a ``bias``, ``bias``.
    """
    ops = NumpyOps()
    layer = LayerOptions.of(options)
    w, queries, keys, values, lens, heads = _reference_inputs(
        weights, queries, keys, values, valid_lens, num_heads, num_kv_heads, causal
    )
    batch, num_queries = queries.shape[:2]
    num_keys = keys.shape[1]
    positions = _reference_positions(positions, batch, num_queries, num_keys)
    bias = _reference_bias(bias, heads, batch, num_queries, num_keys)
    head_dim = heads.head_dim
    grad_out = _as_float64(output_gradient)
    scale = 1.0 / math.sqrt(head_dim)

    projected = _reference_projections(w, queries, keys, values, heads, layer.rotary, positions)
    # The grouped layout (docs: "The spec"): (B*H_kv, G*Q, dh) queries against
    # (B*H_kv, K, dh) keys and values; with G = 1 it is d2l's (B*H, Q, dh).
    kv_heads, group = heads.num_kv_heads, heads.group_size
    q = transpose_grouped_queries(ops, projected["q"], kv_heads, group)
    k, v = (transpose_qkv(ops, projected[n], kv_heads) for n in "kv")
    raw_scores = grouped_to_heads(ops, scaled_scores(ops, q, k, head_dim), kv_heads, group)
    score_options = layer.score_options(num_heads=heads.num_heads, bias=bias)
    scores = adjust_scores(ops, raw_scores, score_options)  # (B, H, Q, K)
    visible = visibility(
        ops, num_queries, num_keys, lens, causal=causal, window=score_options.window
    )
    attn = heads_to_grouped(ops, masked_softmax(ops, scores, visible), kv_heads, group)
    context = transpose_grouped_output(ops, attn @ v, kv_heads, group)
    gates = _reference_head_mask(head_mask, heads, batch)

    grads: dict[str, np.ndarray] = {}
    grads["W_o"] = np.einsum(
        "bqi,bqj->ij", apply_head_mask(ops, context, gates, heads.num_heads), grad_out
    )
    if "b_o" in w:
        grads["b_o"] = grad_out.sum(axis=(0, 1))
    grad_context = grad_out @ w["W_o"].T  # (B, Q, H*dh), of the gated context
    if gates is not None:
        # d(context_h * gate_h): the gate's gradient sums its head's products,
        # over the batch too for one gate per head.
        per_head = (grad_context * context).reshape(
            *context.shape[:2], heads.num_heads, heads.head_dim
        )
        grad_gates = per_head.sum(axis=(1, 3))  # (B, H)
        grads["head_mask"] = grad_gates if gates.ndim == 2 else grad_gates.sum(axis=0)
        grad_context = apply_head_mask(ops, grad_context, gates, heads.num_heads)
    grad_heads = transpose_grouped_queries(ops, grad_context, kv_heads, group)
    grad_attn = grad_heads @ np.swapaxes(v, -1, -2)  # d(attn @ v) / d attn
    # A key/value head's gradient sums over its whole group (the G*Q rows).
    grad_v = np.swapaxes(attn, -1, -2) @ grad_heads
    grad_scores = attn * (grad_attn - (grad_attn * attn).sum(axis=-1, keepdims=True))
    grad_scores = grouped_to_heads(ops, grad_scores, kv_heads, group)  # (B, H, Q, K)
    if visible is not None:
        grad_scores = np.where(visible, grad_scores, 0.0)
    if bias is not None:
        grads["bias"] = _sum_to_shape(grad_scores, bias.shape)  # the bias is added
    if layer.softcap is not None:
        grad_scores = grad_scores * (1.0 - np.tanh(raw_scores / layer.softcap) ** 2)
    grad_scores = heads_to_grouped(ops, grad_scores, kv_heads, group)
    grad_q = grad_scores @ k * scale
    grad_k = np.swapaxes(grad_scores, -1, -2) @ q * scale

    inputs = {"q": ("queries", queries), "k": ("keys", keys), "v": ("values", values)}
    projected_grads = {
        "q": transpose_grouped_output(ops, grad_q, kv_heads, group),
        "k": transpose_output(ops, grad_k, kv_heads),
        "v": transpose_output(ops, grad_v, kv_heads),
    }
    if layer.rotary is not None:
        query_positions, key_positions = call_positions(
            ops, positions, num_queries=num_queries, num_keys=num_keys
        )
        for name, at, count in (
            ("q", query_positions, heads.num_heads),
            ("k", key_positions, kv_heads),
        ):
            projected_grads[name] = rotate(
                ops, projected_grads[name], at, layer.rotary, count, head_dim, inverse=True
            )
    for name, grad_projected in projected_grads.items():
        input_name, x = inputs[name]
        grads[f"W_{name}"] = np.einsum("bti,btj->ij", x, grad_projected)
        if f"b_{name}" in w:
            grads[f"b_{name}"] = grad_projected.sum(axis=(0, 1))
        grads[input_name] = grad_projected @ w[f"W_{name}"].T
    return grads


def reference_cached_forward(
    weights: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    cache: KVCache,
    valid_lens: Any = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    head_mask: Any = None,
    positions: Any = None,
    bias: Any = None,
    **options: Any,
) -> tuple[np.ndarray, np.ndarray, KVCache]:
    """A cached call evaluated in float64 numpy, one example, head and query at a time.

    Written without :func:`update_cache`, :func:`visibility` or
    :func:`adjust_scores`, from the rules of the docs ("Generating with a
    cache", "Positions and biases"), so that it checks them.

    Args:
        weights: canonical weights.
        queries: ``(B, T, query_size)``.
        keys: ``(B, T, key_size)``, or ``None`` to append nothing.
        values: ``(B, T, value_size)``, or ``None``.
        cache: numpy ``keys``/``values`` ``(B, num_kv_heads, M, head_dim)``
            and ``lengths`` ``(B,)``.
        valid_lens: ``None`` or ``(B,)``: new positions per example.
        num_heads, num_kv_heads: as in :func:`reference_forward`.
        causal: query ``i`` of example ``b`` sees key ``j`` only when ``j <=
            lengths[b] + i``.
        head_mask: ``None``, ``(H,)`` or ``(B, H)`` gates of the heads' context.
        positions: ``None`` or integer ``(B, T)``: the rotary positions of
            the queries and the new keys; ``None`` for ``lengths[b] + i``.
        bias: ``None``, or floating, broadcastable to ``(B, H, T, M)``.
        **options: ``rotary``, ``alibi``, ``window``, ``softcap``
            (:class:`LayerOptions`). ALiBi and the window place query ``i``
            of example ``b`` at ``lengths[b] + i`` and key ``j`` at ``j``;
            keys older than the window stay in the cache, hidden.

    Returns:
        ``(output, attention_weights, cache)``: ``(B, T, num_hiddens)``,
        ``(B, H, T, M)`` and the cache after the call (float64, lengths int32).
    """
    layer = LayerOptions.of(options)
    w = {name: _as_float64(value) for name, value in weights.items()}
    heads = heads_of_weights(w, num_heads, num_kv_heads=num_kv_heads)
    queries = _as_float64(queries)
    cache_keys, cache_values = (_as_float64(x).copy() for x in (cache.keys, cache.values))
    lengths = np.asarray(cache.lengths).astype(np.int64)
    batch, num_new = queries.shape[:2]
    max_length = cache_keys.shape[2]
    if keys is None:
        new = np.zeros(batch, np.int64)
    else:
        new = np.full(batch, num_new) if valid_lens is None else np.asarray(valid_lens)
    check_cache_values(lengths, new, num_new, max_length)
    gates = _reference_head_mask(head_mask, heads, batch)
    if gates is not None and gates.ndim == 1:
        gates = np.broadcast_to(gates, (batch, heads.num_heads))
    positions = _reference_positions(positions, batch, num_new, None)
    bias = _reference_bias(bias, heads, batch, num_new, max_length)
    if bias is not None:
        bias = np.broadcast_to(bias, (batch, heads.num_heads, num_new, max_length))
    slopes = alibi_slopes(heads.num_heads) if layer.alibi else None
    if positions is None:
        positions = lengths[:, None] + np.arange(num_new)  # each example's own positions
    ops = NumpyOps()
    dh, group = heads.head_dim, heads.group_size
    with np.errstate(invalid="ignore", over="ignore"):
        q = _linear(queries, w, "q")
        if layer.rotary is not None:
            q = rotate(ops, q, positions, layer.rotary, heads.num_heads, dh)
        if keys is not None:
            projected_k = _linear(_as_float64(keys), w, "k")
            if layer.rotary is not None:  # keys enter the cache rotated
                projected_k = rotate(
                    ops, projected_k, positions, layer.rotary, heads.num_kv_heads, dh
                )
            projected_k = projected_k.reshape(
                batch, num_new, -1 if num_new else heads.num_kv_heads, dh
            )
            projected_v = _linear(_as_float64(values), w, "v").reshape(
                batch, num_new, -1 if num_new else heads.num_kv_heads, dh
            )
            for b in range(batch):
                start, stop = lengths[b], lengths[b] + new[b]
                cache_keys[b, :, start:stop] = projected_k[b, : new[b]].transpose(1, 0, 2)
                cache_values[b, :, start:stop] = projected_v[b, : new[b]].transpose(1, 0, 2)
        q = q.reshape(batch, num_new, heads.num_heads, dh)
        attention_weights = np.zeros((batch, heads.num_heads, num_new, max_length))
        context = np.zeros((batch, num_new, heads.num_heads, dh))
        key_positions = np.arange(max_length)
        # An empty cache (max_length 0) has no key: the context is 0, as with K = 0.
        for b in range(batch if max_length else 0):
            for i in range(num_new):
                at = lengths[b] + i  # the query's position among the keys
                seen = lengths[b] + (min(new[b], i + 1) if causal else new[b])
                visible = key_positions < seen
                if layer.window is not None:
                    visible &= at - key_positions < layer.window
                for h in range(heads.num_heads):
                    scores = cache_keys[b, h // group] @ q[b, i, h] / math.sqrt(dh)
                    if layer.softcap is not None:
                        scores = layer.softcap * np.tanh(scores / layer.softcap)
                    if bias is not None:
                        scores = scores + bias[b, h, i]
                    if slopes is not None:
                        scores = scores + slopes[h] * (key_positions - at)
                    scores = np.where(visible, scores, MASK_VALUE)
                    row = np.exp(scores - scores.max())
                    row = row / row.sum()
                    attention_weights[b, h, i] = row
                    context[b, i, h] = row @ cache_values[b, h // group]
                    if gates is not None:
                        context[b, i, h] *= gates[b, h]
        output = _linear(context.reshape(batch, num_new, heads.query_features), w, "o")
    updated = KVCache(cache_keys, cache_values, (lengths + new).astype(np.int32))
    return output, attention_weights, updated
