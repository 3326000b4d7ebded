"""The options of the attention's scores: ALiBi, windows, soft-capping, sinks, bias, positions.

The constructor's options (:class:`LayerOptions`) and what one call does to
the scores of every head (:class:`ScoreOptions`), checked (docs: "Positions
and biases"). Rotary embeddings are in :mod:`mha_multi.spec.rotary`, the
query/key norms in :mod:`mha_multi.spec.norms`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mha_multi.spec.checks import check_flag, check_positive_int, check_positive_real, one_of
from mha_multi.spec.norms import QKNorm, check_qk_norm
from mha_multi.spec.ops import Array
from mha_multi.spec.rotary import Rotary, check_rotary
from mha_multi.spec.sinks import check_sinks


def check_alibi(alibi: Any) -> bool:
    """Raises ``TypeError`` unless ``alibi`` is a bool (:func:`check_flag`)."""
    return check_flag("alibi", alibi)


def check_window(window: Any) -> int | None:
    """``window`` as ``None`` or a positive int below 2**31: the positions a query may see
    back.

    Raises:
        TypeError: not ``None`` or an int.
        ValueError: not positive (a window of 0 would hide every key), or 2**31 or
            more: positions are compared as 32-bit integers in places (JAX without
            ``jax_enable_x64``, MXNet, Keras on PyTorch), where such a window wraps,
            and no sequence is that long (``None`` is no window).
    """
    if window is None:
        return None
    check_positive_int("window", window)
    if window >= 2**31:
        raise ValueError(f"window must be below 2**31 (None for no window); got {window}")
    return int(window)


#: The largest soft cap: scores over a larger one fall below float32's smallest normal
#: number (``2**-126``) where they exceed ``2**-62``, and XLA and TensorFlow flush such
#: numbers to zero (docs: "Edge cases"); below it, what they flush is below ``2**-62``.
SOFTCAP_LIMIT = 2.0**64
#: The smallest soft cap, float32's smallest normal number: XLA and TensorFlow flush a
#: smaller one to zero, and a score of 0 over it is 0 / 0 there (docs: "Edge cases").
SOFTCAP_SMALLEST = 2.0**-126


def check_softcap(softcap: Any) -> float | None:
    """``softcap`` as ``None`` or a positive finite float from :data:`SOFTCAP_SMALLEST` to
    :data:`SOFTCAP_LIMIT`.

    Raises:
        TypeError: not ``None`` or a number.
        ValueError: not positive and finite, or outside those bounds.
    """
    if softcap is None:
        return None
    checked = check_positive_real("softcap", softcap)
    if checked > SOFTCAP_LIMIT:
        raise ValueError(
            "softcap must be at most 2**64 (scores divided by more fall below float32's "
            f"normal numbers, which XLA and TensorFlow flush to zero); got {softcap!r}"
        )
    if checked < SOFTCAP_SMALLEST:
        raise ValueError(
            "softcap must be at least 2**-126 (float32's smallest normal number: XLA and "
            f"TensorFlow flush a smaller one to zero); got {softcap!r}"
        )
    return checked


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi slopes of ``num_heads`` heads, float64 ``(num_heads,)``.

    For ``H`` a power of two, head ``h`` (from 0) has ``2 ** (-8 (h + 1) / H)``
    (Press et al., 2022). Otherwise, as BLOOM's ``build_alibi_tensor``: the
    slopes of the largest power of two ``P < H``, then every other slope of
    ``2 P`` heads (``2 ** (-4 k / P)`` for odd ``k``) for the remaining
    ``H - P`` heads. Each slope is one float64 power of two, not a product of
    rounded powers.
    """
    check_positive_int("num_heads", num_heads)
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
    check_positions_kind(positions_kind)
    shape = tuple(positions_shape)
    if not one_of(shape, (batch, num_queries), (1, num_queries)):
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


def check_positions_kind(positions_kind: str) -> None:
    """Raises ``TypeError`` unless ``positions`` of numpy dtype kind ``positions_kind``
    are integers (:func:`check_positions`' first check)."""
    if positions_kind not in "iu":
        raise TypeError(f"positions must be integers; got dtype kind {positions_kind!r}")


def positions_on_host(positions: Any, index: Any = np.int64) -> np.ndarray:
    """``positions`` given on the host (a numpy array, a list) as an integer numpy array
    of ``index``, checked before any conversion could wrap them: the widest integers the
    framework holds (PyTorch and MXNet have no unsigned 64-bit arrays, and a call's
    length, its largest position + 1, would wrap in a narrow dtype: an int8's 127).

    Args:
        positions: the call's ``positions`` as given.
        index: the widest integer dtype the framework holds here (JAX, and Keras
            on JAX, hold int32 without ``jax_enable_x64``).

    Raises:
        TypeError: not integers (:func:`check_positions_kind`).
        ValueError: a position beyond ``index`` (unsigned ones of 2**63 or more
            beyond int64), which a conversion would wrap.
    """
    array = np.asarray(positions)
    check_positions_kind(array.dtype.kind)
    if array.size:
        bounds, low, high = np.iinfo(index), int(array.min()), int(array.max())
        if high > bounds.max or low < bounds.min:
            raise ValueError(
                f"positions must fit in {np.dtype(index).name}, the integers the framework "
                f"holds here; got {high if high > bounds.max else low}"
            )
    return array.astype(index)


def check_bias_kind(bias_kind: str) -> None:
    """Raises ``TypeError`` unless a ``bias`` of numpy dtype kind ``bias_kind`` is
    floating-point (:func:`check_bias`' first check)."""
    if bias_kind != "f":
        raise TypeError(f"bias must be a floating-point array; got dtype kind {bias_kind!r}")


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
    check_bias_kind(bias_kind)
    shape = tuple(bias_shape)
    target = (batch, num_heads, num_queries, num_keys)
    if len(shape) > 4 or any(
        # (Compared one by one: see one_of.)
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
        sinks: ``None``, or the ``(H,)`` sink logits of the heads this call
            computes (the layer's parameter, :mod:`mha_multi.spec.sinks`):
            one more column of every row's softmax, dropped from the weights.
        segments: ``None``, or the boolean ``(B, 1, Q, K)`` visibility of
            packed sequences (:func:`~mha_multi.spec.segments.segment_visibility`),
            joined to the other masks.
    """

    softcap: float | None = None
    bias: Array | None = None
    alibi_slopes: np.ndarray | None = None
    window: int | None = None
    query_positions: Array | None = None
    sinks: Array | None = None
    segments: Array | None = None

    @property
    def adjusts_scores(self) -> bool:
        """Whether :func:`adjust_scores` changes the scores."""
        return self.softcap is not None or self.bias is not None or self.alibi_slopes is not None

    def with_sinks(self, sinks: Array | None) -> ScoreOptions:
        """These options with the heads' ``(H,)`` sink logits (``None``: none)."""
        return dataclasses.replace(self, sinks=sinks)

    @property
    def only_segments(self) -> bool:
        """Whether packed sequences' visibility is all these options hold: a kernel that
        takes any boolean mask takes them, whether or not it takes the others."""
        return (
            self.segments is not None
            and not self.adjusts_scores
            and self.window is None
            and self.query_positions is None
            and self.sinks is None
        )

    def with_segments(self, segments: Array | None) -> ScoreOptions:
        """These options with the packed sequences' visibility (``None``: none)."""
        return self if segments is None else dataclasses.replace(self, segments=segments)


#: No option: d2l's scores.
NO_OPTIONS = ScoreOptions()


_LAYER_OPTIONS = ("rotary", "alibi", "window", "softcap", "sinks", "qk_norm")


@dataclass(frozen=True)
class LayerOptions:
    """The constructor options of docs "Positions and biases"; the defaults are d2l's layer.

    Attributes:
        rotary: ``None`` or a :class:`Rotary` (a dict of its fields before
            :meth:`check`).
        alibi: add ALiBi's per-head linear bias (:func:`alibi_slopes`).
        window: ``None`` or the sliding window (:func:`check_window`).
        softcap: ``None`` or the soft cap of the scores (:func:`check_softcap`).
        sinks: each head has a learned sink logit (the canonical weight
            ``sinks``, ``(num_heads,)``) that joins every query's softmax,
            taking weight but giving no value (:mod:`mha_multi.spec.sinks`).
        qk_norm: ``None`` or the RMSNorm of the projected queries and keys
            (a :class:`QKNorm`, or a dict of its fields before :meth:`check`).
    """

    rotary: Rotary | Mapping[str, Any] | None = None
    alibi: bool = False
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    qk_norm: QKNorm | Mapping[str, Any] | None = None

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
                :func:`check_sinks`, :func:`check_qk_norm`, :meth:`Rotary.dim`.
        """
        options = LayerOptions(
            rotary=check_rotary(self.rotary),
            alibi=check_alibi(self.alibi),
            window=check_window(self.window),
            softcap=check_softcap(self.softcap),
            sinks=check_sinks(self.sinks),
            qk_norm=check_qk_norm(self.qk_norm),
        )
        if head_dim is not None and options.rotary is not None:
            options.rotary.dim(head_dim)
        return options

    def config(self) -> dict[str, Any]:
        """The options as plain Python values (``rotary`` and ``qk_norm`` dicts), as
        constructors take them."""
        rotary, qk_norm = self.rotary, self.qk_norm
        if isinstance(rotary, Rotary):
            rotary = dataclasses.asdict(rotary)
        if isinstance(qk_norm, QKNorm):
            qk_norm = dataclasses.asdict(qk_norm)
        return {
            "rotary": rotary,
            "alibi": self.alibi,
            "window": self.window,
            "softcap": self.softcap,
            "sinks": self.sinks,
            "qk_norm": qk_norm,
        }

    def __post_init__(self) -> None:
        # Every call of a layer asks both, and the options never change: decided once.
        # (Plain attributes, not functools.cached_property: Python 3.11's takes a lock,
        # which torch.compile cannot trace.)
        # (Of values not yet checked too: an array given for a flag is no default, and
        # check() names it.)
        others_default = all(
            _is_default(getattr(self, field.name), field.default)
            for field in dataclasses.fields(self)
            if field.name != "rotary"
        )
        touches = (
            not _is_default(self.alibi, False)
            or self.window is not None
            or self.softcap is not None
            or not _is_default(self.sinks, False)
        )
        object.__setattr__(self, "touches_scores", touches)
        object.__setattr__(self, "is_default", self.rotary is None and others_default)

    # Set on each instance by __post_init__; not a field, so that
    # dataclasses.asdict and replace see the options alone.
    #: Whether an option acts on the scores or their softmax (ALiBi, the window,
    #: soft-capping, sinks): else a call's :class:`ScoreOptions` are d2l's, of rotated or
    #: normalised queries and keys.
    touches_scores: ClassVar[bool]
    #: Whether these are d2l's layer (no option set; an attribute, not a property: every
    #: call of the generic flow asks).
    is_default: ClassVar[bool]

    def score_options(
        self, *, num_heads: int, bias: Array | None = None, query_positions: Array | None = None
    ) -> ScoreOptions:
        """The :class:`ScoreOptions` of one call of a layer with these (checked) options.

        A layer with ``sinks=True`` adds its logits with :meth:`ScoreOptions.with_sinks`.

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


def _is_default(value: Any, default: Any) -> bool:
    """Whether an option's value, checked or not, is its field's default (``None`` or
    ``False``); an array, whose comparison is no bool, is none."""
    if value is default:
        return True
    try:
        return bool(value == default)
    except (TypeError, ValueError):
        return False
