"""The layer's configuration and a call's inputs checked: shapes, sizes and dtypes, no values.

Pure Python on shapes and dtype kinds, so every backend raises the same
exception with the same message for the same mistake (docs: "Edge cases").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np


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

    def __post_init__(self) -> None:
        # Plain attributes, set once: every call reads them, and a property is a
        # function call each time (docs: "Results", calls per call).
        derived = {
            "group_size": self.num_heads // self.num_kv_heads,
            "grouped": self.num_kv_heads != self.num_heads,
            "query_features": self.num_heads * self.head_dim,
            "kv_features": self.num_kv_heads * self.head_dim,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    # Set on each instance by __post_init__; not fields, so that
    # dataclasses.asdict and replace see the three sizes alone.
    #: Query heads per key/value head.
    group_size: ClassVar[int]
    #: Whether key/value heads are shared (``num_kv_heads < num_heads``).
    grouped: ClassVar[bool]
    #: ``num_heads * head_dim``: the width of projected queries and of ``W_o``'s input.
    query_features: ClassVar[int]
    #: ``num_kv_heads * head_dim``: the width of projected keys and values.
    kv_features: ClassVar[int]


def check_positive_int(name: str, value: Any) -> None:
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
    check_positive_int("num_hiddens", num_hiddens)
    check_positive_int("num_heads", num_heads)
    if num_kv_heads is None:
        num_kv_heads = num_heads
    check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    if head_dim is None:
        if num_hiddens % num_heads:
            raise ValueError(
                f"num_hiddens ({num_hiddens}) must be divisible by num_heads ({num_heads}), "
                "or head_dim must be given"
            )
        head_dim = num_hiddens // num_heads
    check_positive_int("head_dim", head_dim)
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
    check_positive_int("num_shards", num_shards)
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
    """Validates optional input sizes (``query_size=...`` etc.): positive ints or None.

    Raises:
        TypeError: a size that is no int (a bool, a float, a string), as every other
            size of the constructor is refused.
        ValueError: an int that is not positive.
    """
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be a positive int or None; got {value!r}")
        if value <= 0:
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


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool; raises ``TypeError`` naming ``name`` unless it is one.

    A string such as ``"False"`` is truthy and an array has no single truth
    value, so anything but a bool would silently switch the flag on (a mask,
    biases, the weights returned) or fail deep inside a framework.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r} of type {type(value).__name__}")
    return bool(value)


def check_causal(causal: Any) -> None:
    """Raises ``TypeError`` unless ``causal`` is a bool (:func:`check_flag`)."""
    check_flag("causal", causal)


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
        if size is None and shape[2] == 0:
            # (The layer learns its size from it, which a layer refuses to be made with.)
            raise ValueError(
                f"{name} last dimension must be positive: it sets the layer's {size_name}; "
                f"got shape {shape}"
            )
    if valid_lens_shape is not None:
        check_valid_lens_shape(valid_lens_shape, batch, shapes[0][1])


def check_valid_lens_shape(valid_lens_shape: Sequence[Any], batch: Any, num_queries: Any) -> None:
    """Raises ``ValueError`` unless ``valid_lens`` are ``(B,)`` or ``(B, Q)``.

    Args:
        valid_lens_shape: the lengths' shape.
        batch: ``B``.
        num_queries: ``Q``.
    """
    lens_shape = tuple(valid_lens_shape)
    if not one_of(lens_shape, (batch,), (batch, num_queries)):
        raise ValueError(
            f"valid_lens must have shape (batch,) = ({batch},) or "
            f"(batch, num_queries) = ({batch}, {num_queries}); got {lens_shape}"
        )


def one_of(shape: tuple[Any, ...], *allowed: tuple[Any, ...]) -> bool:
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


def lens_as_numpy(valid_lens: Any, index_dtype: Any, float_dtype: Any = None) -> np.ndarray:
    """Lengths given as a numpy array, a list or a scalar, checked and converted.

    What each backend does with lengths that are not yet its own arrays.

    Args:
        valid_lens: array-like lengths.
        index_dtype: the framework's integer type; integer lengths are clipped
            into it (:func:`clip_integer_lens`), floating ones kept.
        float_dtype: ``None``, or the widest floating type the framework
            holds where it is narrower than float64 (JAX without x64:
            float32); wider floating lengths are narrowed to it keeping the
            keys they show (:func:`narrow_float_lens`).

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
    if float_dtype is not None and array.dtype.kind == "f":
        return narrow_float_lens(array, float_dtype)
    return clip_integer_lens(array, index_dtype)


def narrow_float_lens(valid_lens: np.ndarray, dtype: Any) -> np.ndarray:
    """Floating lengths as the floating ``dtype``, each showing the keys it shows.

    Key ``j`` is visible iff ``j < len``, which for an integer ``j`` is
    ``j < ceil(len)``: a length rounded to a narrower type may cross an
    integer (float64's ``2 + 1e-9`` rounds to float32's 2 and would hide key
    2, ``5e-324`` to 0 and would hide key 0), its ceiling does not (every
    integer up to ``2**24`` is a float32; NaN and infinities stay what they
    are). Lengths no wider than ``dtype`` are returned unchanged.
    """
    if valid_lens.dtype.itemsize <= np.dtype(dtype).itemsize:
        return valid_lens
    with np.errstate(invalid="ignore"):
        return np.ceil(valid_lens).astype(dtype)


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


def check_positive_real(name: str, value: Any) -> float:
    """``value`` as a positive finite float; ``name`` is the argument's name in messages."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"{name} must be a positive finite number; got {value!r}")
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{name} must be a positive finite number; got {value!r}")
    return float(value)


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
    check_positive_int("num_heads", num_heads)
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
