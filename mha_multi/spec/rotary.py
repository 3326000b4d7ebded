"""Rotary position embeddings: the option's value, its frequencies and the rotation.

Docs: "Positions and biases". The frequencies are computed once on the host
in float64; the rotation is written once against the array-ops adapter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mha_multi.spec.checks import check_positive_int, check_positive_real
from mha_multi.spec.ops import Array, ArrayOps

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
                self, name, check_positive_real(f"rotary.scaling.{name}", getattr(self, name))
            )
        if self.high_freq_factor <= self.low_freq_factor:
            # The interpolation divides by their difference.
            raise ValueError(
                f"rotary.scaling.high_freq_factor ({self.high_freq_factor}) must be greater "
                f"than rotary.scaling.low_freq_factor ({self.low_freq_factor})"
            )
        check_positive_int(
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


def _fields(value: Any, name: str, kind: type, keys: Sequence[str]) -> dict[str, Any]:
    """The fields of an option given as a dict, for ``kind(**fields)``.

    Raises:
        TypeError: ``value`` is not a mapping; the message names the option
            ``name`` and what it may be (``None``, a ``kind`` or a dict of ``keys``).
    """
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be None, a mha_multi.spec.{kind.__name__} or a dict with keys "
            f"{', '.join(keys)}; got {value!r}"
        )
    return dict(value)


def _check_scaling(scaling: Any) -> Llama3Scaling | None:
    if scaling is None or isinstance(scaling, Llama3Scaling):
        return scaling
    fields = _fields(scaling, "rotary.scaling", Llama3Scaling, _LLAMA3_KEYS)
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
        object.__setattr__(self, "theta", check_positive_real("rotary.theta", self.theta))
        fraction = check_positive_real("rotary.fraction", self.fraction)
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
        check_positive_int("head_dim", head_dim)
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
    fields = _fields(rotary, "rotary", Rotary, _ROTARY_KEYS)
    unknown = sorted(set(fields) - set(_ROTARY_KEYS))
    if unknown:
        raise ValueError(
            f"rotary has unknown keys {unknown}; the keys are {', '.join(_ROTARY_KEYS)}"
        )
    return Rotary(**fields)


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
