"""Rotary position embeddings: the option's value, its frequencies and the rotation.

Docs: "Positions and biases". The frequencies are computed on the host in
float64 (the rotary types in :mod:`mha_multi.spec.rotary_scaling`); those of
a call whose length is in its values, on the device, through the array-ops
adapter. The rotation is written once against the adapter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mha_multi.spec.checks import check_positive_int, check_positive_real
from mha_multi.spec.ops import Array, ArrayOps
from mha_multi.spec.rotary_scaling import (
    Llama3Scaling,
    RotaryScaling,
    check_scaling,
    option_fields,
)

__all__ = ["Llama3Scaling", "Rotary", "check_rotary", "rotary_length", "rotary_tables", "rotate"]


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
        scaling: ``None`` (transformers' ``rope_type="default"``), or a
            rotary type of :mod:`mha_multi.spec.rotary_scaling`
            (:class:`Llama3Scaling`, :class:`LinearScaling`,
            :class:`DynamicScaling`, :class:`YarnScaling`,
            :class:`LongRopeScaling`), or a dict of its fields tagged with
            its ``rope_type`` (untagged: Llama 3's).

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range,
            naming it.
    """

    theta: float = 10000.0
    fraction: float = 1.0
    interleaved: bool = False
    scaling: RotaryScaling | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "theta", check_positive_real("rotary.theta", self.theta))
        fraction = check_positive_real("rotary.fraction", self.fraction)
        if fraction > 1.0:
            raise ValueError(f"rotary.fraction must be in (0, 1]; got {self.fraction!r}")
        object.__setattr__(self, "fraction", fraction)
        if not isinstance(self.interleaved, (bool, np.bool_)):
            raise TypeError(f"rotary.interleaved must be a bool; got {self.interleaved!r}")
        object.__setattr__(self, "interleaved", bool(self.interleaved))
        object.__setattr__(self, "scaling", check_scaling(self.scaling))
        if self.theta == 1.0 and getattr(self.scaling, "rope_type", None) == "yarn":
            # (Its correction range is a quotient of logarithms of theta.)
            raise ValueError(
                "rotary.theta must not be 1 with rope_type 'yarn': its correction range "
                "divides by ln(theta)"
            )

    @property
    def depends_on_length(self) -> bool:
        """Whether the frequencies depend on the call's length (``dynamic``, ``longrope``)."""
        return self.scaling is not None and self.scaling.depends_on_length

    def dim(self, head_dim: int) -> int:
        """The rotated size of a head: ``int(head_dim * fraction)``, as transformers rounds it.

        Raises:
            ValueError: that size is odd or 0 (entries rotate in pairs), or
                the scaling's factors per pair are not ``dim / 2``.
        """
        check_positive_int("head_dim", head_dim)
        rotated = int(head_dim * self.fraction)
        if rotated < 2 or rotated % 2:
            raise ValueError(
                f"rotary.fraction ({self.fraction}) of head_dim ({head_dim}) rotates "
                f"{rotated} entries; rotation needs an even number, at least 2"
            )
        if self.scaling is not None:
            self.scaling.check_pairs(rotated // 2)
        return rotated

    def inverse_frequencies(self, head_dim: int, length: int | None = None) -> np.ndarray:
        """``(dim / 2,)`` float64 frequencies ``theta ** (-2 i / dim)``, scaled if asked.

        Computed on the host in float64; backends take them as constants
        (:meth:`ArrayOps.constant`), rounded to float32 for inputs of 32
        bits or fewer.

        Args:
            head_dim: the size of each head.
            length: the call's length (its largest position + 1), for the
                types whose frequencies depend on it (:attr:`depends_on_length`);
                ``None`` for a length within the original context.
        """
        inv = self.default_frequencies(head_dim)
        if self.scaling is None:
            return inv
        if self.depends_on_length:
            at = float(0 if length is None else length)
            return self.scaling.at_length(_HOST_LENGTH, np.asarray, inv, at)
        return self.scaling.frequencies(inv, self.theta, self.dim(head_dim))

    def default_frequencies(self, head_dim: int) -> np.ndarray:
        """``(dim / 2,)`` float64 ``theta ** (-2 i / dim)``: transformers' ``default`` type."""
        rotated = self.dim(head_dim)
        return 1.0 / self.theta ** (np.arange(0, rotated, 2, dtype=np.float64) / rotated)


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
    fields = option_fields(rotary, "rotary", "Rotary", _ROTARY_KEYS)
    unknown = sorted(set(fields) - set(_ROTARY_KEYS))
    if unknown:
        raise ValueError(
            f"rotary has unknown keys {unknown}; the keys are {', '.join(_ROTARY_KEYS)}"
        )
    return Rotary(**fields)


def rotary_length(ops: ArrayOps, positions: Array, other: Array | None = None) -> Array | int:
    """A call's length on the device: its largest position + 1 over the whole batch.

    What the frequencies of ``dynamic`` and ``longrope`` depend on (docs:
    "Positions and biases"): one reduction on the device, no read on the
    host. The length of a call without ``positions`` is known from shapes
    (or from a cache's lengths already read), and callers pass it as an int.

    Args:
        ops: the array-ops adapter.
        positions: the call's integer positions, ``(B|1, T)`` or ``(T,)``.
        other: the keys' positions where they are another array (an
            uncached call without ``positions``: ``arange(Q)`` and
            ``arange(K)``, both 1-D), or ``None``.

    Returns:
        A 0-d integer array (float32 for positions of 16 bits or fewer), or 0 where
        every positions array is empty.
    """
    arrays = [positions] if other is None or other is positions else [positions, other]
    arrays = [p for p in arrays if not any(ops.size(p, a) == 0 for a in range(ops.ndim(p)))]
    if not arrays:
        return 0
    joined = arrays[0] if len(arrays) == 1 else ops.concat_last(arrays)
    largest = ops.largest(joined)
    if ops.itemsize(ops.dtype(largest)) <= 2:
        # (A narrow integer's largest + 1 may wrap, an int8's 127; float32 holds them all.)
        largest = ops.cast(largest, ops.float32())
    return largest + 1


class _HostLength:
    """The operations :meth:`RotaryScaling.at_length` asks of a length known on the
    host, a Python float: its comparisons and products are Python's, the numbers of
    float64 arrays. (A tracer, ``torch.compile``'s, evaluates Python's numbers as it
    traces; numpy's 0-d arrays it would trace as tensors, whose dtype it cannot read.)
    """

    @staticmethod
    def greater_equal(x: float, y: float) -> bool:
        return x >= y

    @staticmethod
    def where(condition: bool, x: float, fill: float) -> float:
        return x if condition else fill

    @staticmethod
    def dtype(x: Any) -> None:
        return None  # (what cast takes below: a Python float)

    @staticmethod
    def cast(x: bool, dtype: None) -> float:
        return float(x)


_HOST_LENGTH: Any = _HostLength()


def rotary_tables(
    ops: ArrayOps,
    x: Array,
    positions: Array,
    rotary: Rotary,
    head_dim: int,
    *,
    length: Array | int | None = None,
) -> tuple[Array, Array]:
    """The cosines and sines of the angles ``positions * inverse_frequencies``, scaled.

    The angles are float32 for inputs of 32 bits or fewer (float64 for
    float64), so 16-bit inputs rotate by float32 angles (docs: "Positions
    and biases"), and a float32 angle is the one rounding of the product of
    two float32 numbers, as transformers computes it. Cosines and sines are
    then multiplied by the rotary type's attention factor (YaRN's and
    LongRoPE's; 1 for the others), in the angles' precision, as transformers
    does.

    Args:
        ops: the array-ops adapter.
        x: what will be rotated; gives the angles' precision and device.
        positions: integer ``(B|1, T)`` or ``(T,)``.
        rotary: the rotation.
        head_dim: the size of each head.
        length: the call's length (largest position + 1) for a rotary type
            that depends on it: an int known on the host, a 0-d array
            (:func:`rotary_length`), or ``None`` for :func:`rotary_length`
            of ``positions``. Unused by the other types.

    Returns:
        ``(cos, sin)``, each ``(B|1, T, 1, dim / 2)`` or ``(T, 1, dim / 2)``:
        one angle per rotated pair, the same for every head.
    """
    wide = ops.itemsize(ops.dtype(x)) >= 8

    def constant(value: np.ndarray) -> Array:
        return ops.constant(value if wide else value.astype(np.float32), x)

    if rotary.depends_on_length and length is None:
        length = rotary_length(ops, positions)
    if not rotary.depends_on_length or isinstance(length, (int, np.integer)):
        inv = constant(rotary.inverse_frequencies(head_dim, length))  # (dim/2,)
    else:  # the length is in the positions' values: the same formula on the device
        length = ops.cast(length, ops.dtype(x) if wide else ops.float32())
        inv = rotary.scaling.at_length(ops, constant, rotary.default_frequencies(head_dim), length)
    angles = ops.expand_dims(ops.cast(positions, ops.dtype(inv)), -1) * inv  # (..., T, dim/2)
    angles = ops.expand_dims(angles, -2)  # (..., T, 1, dim/2): heads broadcast
    cos, sin = ops.cos(angles), ops.sin(angles)
    factor = 1.0 if rotary.scaling is None else rotary.scaling.attention_scaling()
    return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)


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
    length: Array | int | None = None,
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
        inverse: rotate by the opposite angles, times the same attention
            factor (the transpose: what a gradient goes through).
        tables: :func:`rotary_tables` for these positions, where already
            computed (queries and keys at the same positions).
        length: the call's length, for the rotary types that depend on it
            (:func:`rotary_tables`): queries and keys rotate at one length.

    Returns:
        ``x`` rotated, same shape and dtype.
    """
    dtype = ops.dtype(x)
    if tables is None:
        tables = rotary_tables(ops, x, positions, rotary, head_dim, length=length)
    cos, sin = tables
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
