"""The rotary types: how transformers' ``rope_type`` scalings change the frequencies and cos/sin.

Docs: "Positions and biases". One frozen dataclass per type, each tagged
with transformers' ``rope_type`` and computing what transformers' own
``ROPE_INIT_FUNCTIONS`` computes, in float64 on the host: ``linear``,
``dynamic``, ``yarn``, ``longrope`` and ``llama3``. The frequencies of
``dynamic`` and ``longrope`` depend on the call's length (its largest
position + 1); they are written once against the array-ops adapter, so the
same formula runs on the host (a length known from shapes) and on the
device (a length in the positions' values).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mha_multi.spec.checks import check_positive_int, check_positive_real
from mha_multi.spec.ops import Array, ArrayOps

#: Makes a host float64 array an array of the adapter, in the angles' precision.
Constant = Callable[[np.ndarray], Array]

__all__ = [
    "DynamicScaling",
    "LinearScaling",
    "Llama3Scaling",
    "LongRopeScaling",
    "RotaryScaling",
    "YarnScaling",
    "check_scaling",
    "option_fields",
]


class _Scaling:
    """What every rotary type shares: its checks and its defaults.

    Each type's ``rope_type`` (transformers' tag) is a field that is not an
    argument, so ``dataclasses.asdict`` gives the tagged dict (a layer's
    ``get_config``) that :func:`check_scaling` reads back.
    """

    #: Whether the frequencies depend on the call's length (``dynamic``, ``longrope``).
    depends_on_length: ClassVar[bool] = False

    def _positive(self, *names: str) -> None:
        for name in names:
            value = check_positive_real(f"rotary.scaling.{name}", getattr(self, name))
            object.__setattr__(self, name, value)

    def _optional(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) is not None:
                self._positive(name)

    def _length(self, name: str) -> None:
        check_positive_int(f"rotary.scaling.{name}", getattr(self, name))
        object.__setattr__(self, name, int(getattr(self, name)))

    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (its ``attention_scaling``)."""
        return 1.0

    def check_pairs(self, pairs: int) -> None:
        """Raises a ``ValueError`` where the scaling does not fit ``pairs`` rotated pairs."""


@dataclass(frozen=True)
class Llama3Scaling(_Scaling):
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

    rope_type: str = dataclasses.field(default="llama3", init=False)

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        self._positive("factor", "low_freq_factor", "high_freq_factor")
        if self.high_freq_factor <= self.low_freq_factor:
            # The interpolation divides by their difference.
            raise ValueError(
                f"rotary.scaling.high_freq_factor ({self.high_freq_factor}) must be greater "
                f"than rotary.scaling.low_freq_factor ({self.low_freq_factor})"
            )
        self._length("original_max_position_embeddings")

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

    def frequencies(self, inv: np.ndarray, theta: float, dim: int) -> np.ndarray:
        """The scaled frequencies of the default ``inv`` (:meth:`apply`)."""
        return self.apply(inv)


@dataclass(frozen=True)
class LinearScaling(_Scaling):
    """Position interpolation (transformers' ``rope_type="linear"``): frequencies over ``factor``.

    Raises:
        TypeError, ValueError: ``factor`` not a positive finite number.
    """

    rope_type: str = dataclasses.field(default="linear", init=False)

    factor: float

    def __post_init__(self) -> None:
        self._positive("factor")

    def frequencies(self, inv: np.ndarray, theta: float, dim: int) -> np.ndarray:
        """``inv / factor`` (transformers' ``_compute_linear_scaling_rope_parameters``)."""
        return inv / self.factor


@dataclass(frozen=True)
class DynamicScaling(_Scaling):
    """Dynamic NTK scaling (transformers' ``rope_type="dynamic"``): the base grows with the length.

    For a call of length ``s`` (its largest position + 1) the base is
    ``theta * (factor * s' / max_position_embeddings - (factor - 1)) **
    (dim / (dim - 2))`` with ``s' = max(s, max_position_embeddings)``: the
    default frequencies up to ``max_position_embeddings``
    (transformers' ``_compute_dynamic_ntk_parameters``).

    Attributes:
        factor: the scaling factor.
        max_position_embeddings: the model's context length (the config's
            ``max_position_embeddings``).

    Raises:
        TypeError, ValueError: a field not a positive number (an int for
            ``max_position_embeddings``).
    """

    rope_type: str = dataclasses.field(default="dynamic", init=False)
    depends_on_length: ClassVar[bool] = True

    factor: float
    max_position_embeddings: int

    def __post_init__(self) -> None:
        self._positive("factor")
        self._length("max_position_embeddings")

    def at_length(self, ops: ArrayOps, constant: Constant, inv: np.ndarray, length: Array) -> Array:
        """The frequencies at ``length``, a float 0-d array of ``ops``.

        ``theta'' ** (-j / dim)`` is the default frequency times ``growth **
        (-j / (dim - 2))``: one power of the grown base, no second one of theta.
        """
        dim = 2 * len(inv)
        most = float(self.max_position_embeddings)
        length = ops.where(ops.greater_equal(length, most), length, most)
        growth = self.factor * length / most - (self.factor - 1)
        # dim = 2 has the one frequency theta ** 0 = 1 whatever the base.
        exponents = -np.arange(0, dim, 2, dtype=np.float64) / max(dim - 2, 1)
        return constant(inv) * growth ** constant(exponents)


@dataclass(frozen=True)
class YarnScaling(_Scaling):
    """YaRN (transformers' ``rope_type="yarn"``): frequencies ramped between two, cos/sin scaled.

    Frequencies of dimensions below the correction range keep their value,
    those above it are divided by ``factor``, and a linear ramp joins them;
    cos and sin are multiplied by :meth:`attention_scaling`
    (transformers' ``_compute_yarn_parameters``).

    Attributes:
        factor: the context extension factor.
        original_max_position_embeddings: the pretraining context length.
        attention_factor: the factor of cos and sin; ``None`` for YaRN's
            ``0.1 ln(factor) + 1`` (with ``mscale`` and ``mscale_all_dim``
            both set and non-zero, the ratio of the two such terms).
        beta_fast, beta_slow: the rotations that bound the ramp.
        mscale, mscale_all_dim: DeepSeek's terms of the default attention factor.
        truncate: round the correction range outward to whole dimensions.

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range.
    """

    rope_type: str = dataclasses.field(default="yarn", init=False)

    factor: float
    original_max_position_embeddings: int
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        self._positive("factor", "beta_fast", "beta_slow")
        self._optional("attention_factor", "mscale", "mscale_all_dim")
        self._length("original_max_position_embeddings")
        if not isinstance(self.truncate, (bool, np.bool_)):
            raise TypeError(f"rotary.scaling.truncate must be a bool; got {self.truncate!r}")
        object.__setattr__(self, "truncate", bool(self.truncate))

    def attention_scaling(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale: float, weight: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def frequencies(self, inv: np.ndarray, theta: float, dim: int) -> np.ndarray:
        def correction(rotations: float) -> float:
            # The dimension whose wavelength makes ``rotations`` turns in the original context.
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(theta))

        low, high = correction(self.beta_fast), correction(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        kept = 1 - ramp  # the share of each frequency left unscaled
        powers = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        return 1.0 / (self.factor * powers) * (1 - kept) + 1.0 / powers * kept


@dataclass(frozen=True)
class LongRopeScaling(_Scaling):
    """LongRoPE (transformers' ``rope_type="longrope"``, Phi-3): one factor per pair, two sets.

    Frequency ``i`` is the default one over ``short_factor[i]`` for a call
    of length (largest position + 1) up to
    ``original_max_position_embeddings``, over ``long_factor[i]`` beyond;
    cos and sin are multiplied by :meth:`attention_scaling`
    (transformers' ``_compute_longrope_parameters``).

    Attributes:
        short_factor, long_factor: ``dim / 2`` positive numbers each.
        original_max_position_embeddings: the pretraining context length.
        factor: the context extension factor (transformers:
            ``max_position_embeddings / original_max_position_embeddings``
            where the config does not give it); used only for the default
            attention factor.
        attention_factor: the factor of cos and sin; ``None`` for
            ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``
            (1 for ``factor <= 1``).

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range, or
            neither ``factor`` nor ``attention_factor`` given.
    """

    rope_type: str = dataclasses.field(default="longrope", init=False)
    depends_on_length: ClassVar[bool] = True

    short_factor: Sequence[float]
    long_factor: Sequence[float]
    original_max_position_embeddings: int
    factor: float | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            values = getattr(self, name)
            if isinstance(values, (str, bytes, Mapping)) or not isinstance(
                values, (Sequence, np.ndarray)
            ):
                raise TypeError(f"rotary.scaling.{name} must be a list of numbers; got {values!r}")
            checked = tuple(
                check_positive_real(f"rotary.scaling.{name}[{index}]", value)
                for index, value in enumerate(values)
            )
            object.__setattr__(self, name, checked)
        self._length("original_max_position_embeddings")
        self._optional("factor", "attention_factor")
        if self.factor is None and self.attention_factor is None:
            raise ValueError(
                "rotary.scaling of rope_type 'longrope' needs factor (transformers: "
                "max_position_embeddings / original_max_position_embeddings) or attention_factor"
            )
        if (
            self.attention_factor is None
            and self.factor > 1.0
            and self.original_max_position_embeddings == 1
        ):
            raise ValueError(
                "rotary.scaling of rope_type 'longrope' with factor > 1 needs "
                "original_max_position_embeddings > 1 or attention_factor: its default "
                "attention factor divides by ln(original_max_position_embeddings)"
            )

    def attention_scaling(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(
            1 + math.log(self.factor) / math.log(self.original_max_position_embeddings)
        )

    def check_pairs(self, pairs: int) -> None:
        for name in ("short_factor", "long_factor"):
            if len(getattr(self, name)) != pairs:
                raise ValueError(
                    f"rotary.scaling.{name} must have one factor per rotated pair ({pairs}); "
                    f"got {len(getattr(self, name))}"
                )

    def at_length(self, ops: ArrayOps, constant: Constant, inv: np.ndarray, length: Array) -> Array:
        """The frequencies at ``length``, a float 0-d array of ``ops``: short or long.

        A product by 0 or 1, not a ``where``: exact, and the same on every adapter.
        """
        short = constant(inv / np.asarray(self.short_factor))
        long = constant(inv / np.asarray(self.long_factor))
        # length > original, for a length that is a whole number.
        beyond = ops.greater_equal(length, self.original_max_position_embeddings + 1.0)
        beyond = ops.cast(beyond, ops.dtype(short))
        return long * beyond + short * (1 - beyond)


#: The rotary scalings, by transformers' ``rope_type``.
SCALINGS: dict[str, type] = {
    kind.rope_type: kind
    for kind in (LinearScaling, DynamicScaling, YarnScaling, LongRopeScaling, Llama3Scaling)
}

RotaryScaling = LinearScaling | DynamicScaling | YarnScaling | LongRopeScaling | Llama3Scaling


def option_fields(value: Any, name: str, kind: str, keys: Sequence[str]) -> dict[str, Any]:
    """The fields of an option given as a dict, for ``kind(**fields)``.

    Raises:
        TypeError: ``value`` is not a mapping; the message names the option
            ``name`` and what it may be (``None``, a ``kind`` or a dict of ``keys``).
    """
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be None, a mha_multi.spec.{kind} or a dict with keys "
            f"{', '.join(keys)}; got {value!r}"
        )
    return dict(value)


def check_scaling(scaling: Any) -> RotaryScaling | None:
    """``Rotary(scaling=...)`` as a scaling object (or ``None``).

    A dict names its type by ``rope_type`` (or transformers' older
    ``type``); a dict without one is Llama 3's, as before the other types;
    transformers' ``default`` (no other field) is no scaling, ``None``.

    Raises:
        TypeError: not ``None``, a scaling or a dict; or a field of the wrong type.
        ValueError: an unknown ``rope_type``, unknown or missing keys of its
            type (named), or a field out of range.
    """
    if scaling is None or isinstance(scaling, tuple(SCALINGS.values())):
        return scaling
    fields = option_fields(
        scaling, "rotary.scaling", "Llama3Scaling (or another rotary type)", ["rope_type", "..."]
    )
    given = [fields.pop(key) for key in ("rope_type", "type") if key in fields]
    for tag in given:
        if not isinstance(tag, str):
            raise TypeError(f"rotary.scaling rope_type must be a string; got {tag!r}")
    tags = set(given)
    if len(tags) > 1:
        raise ValueError(f"rotary.scaling rope_type and type differ: {sorted(map(str, tags))}")
    kind = tags.pop() if tags else "llama3"
    if kind == "default":  # (transformers' frequencies theta ** (-2i / dim): no scaling)
        if fields:
            raise ValueError(
                f"rotary.scaling of rope_type 'default' has no fields; got {sorted(fields)}"
            )
        return None
    if kind not in SCALINGS:
        raise ValueError(
            f"rotary.scaling rope_type must be one of {', '.join(map(repr, SCALINGS))}; "
            f"got {kind!r}"
        )
    required, optional = _keys(SCALINGS[kind])
    unknown = sorted(set(fields) - set(required) - set(optional))
    missing = [key for key in required if key not in fields]
    if unknown or missing:
        raise ValueError(
            f"rotary.scaling of rope_type {kind!r} must have the keys {', '.join(required)}"
            + (f" (and may have {', '.join(optional)})" if optional else "")
            + f"; unknown {unknown}, missing {missing}"
        )
    return SCALINGS[kind](**fields)


def _keys(kind: type) -> tuple[list[str], list[str]]:
    """A scaling's required and optional fields."""
    required, optional = [], []
    for field in dataclasses.fields(kind):
        if not field.init:  # rope_type: the tag, not a key
            continue
        has_default = field.default is not dataclasses.MISSING
        (optional if has_default else required).append(field.name)
    return required, optional
