"""The semantics of multi-head attention, written once, framework-free.

Every function here takes an *array-ops adapter* (``ops``) as its first
argument: a small object with the handful of array operations the math needs
(:class:`ArrayOps`). :class:`NumpyOps` evaluates the spec in float64 and is
the reference; each backend passes its own adapter, so the head layout, the
``valid_lens`` rule, the causal rule and the masked softmax exist in exactly
one place.

Shapes, following d2l: queries ``(B, Q, query_size)``, keys
``(B, K, key_size)``, values ``(B, K, value_size)``, ``num_hiddens = H * head_dim``.

One job per module (docs: "Architecture"): :mod:`~mha_multi.spec.ops` (the
adapters), :mod:`~mha_multi.spec.checks` (configuration and input checks),
:mod:`~mha_multi.spec.rotary`, :mod:`~mha_multi.spec.rotary_scaling` (the
rotary types), :mod:`~mha_multi.spec.norms`, :mod:`~mha_multi.spec.sinks` and
:mod:`~mha_multi.spec.options` (the options), :mod:`~mha_multi.spec.layout` (the head layout),
:mod:`~mha_multi.spec.positions` (masks, positions, position biases),
:mod:`~mha_multi.spec.segments` (packed sequences),
:mod:`~mha_multi.spec.attention`, :mod:`~mha_multi.spec.plan` (the kernel
plan), :mod:`~mha_multi.spec.cache` and :mod:`~mha_multi.spec.cache_checks`,
and the float64 reference (:mod:`~mha_multi.spec.reference`): pure functions,
whose verdicts the layers above keep per signature in :mod:`~mha_multi.spec.memo`'s
tables. Every public name is read from here
(``mha_multi.spec.X``).
"""

from __future__ import annotations

from mha_multi.spec.attention import (
    MASK_VALUE,
    apply_head_mask,
    attention,
    attention_by_kv_heads,
    check_head_mask,
    fix_fully_hidden_rows,
    is_low_precision,
    masked_softmax,
    scaled_scores,
)
from mha_multi.spec.cache import (
    KVCache,
    appended,
    cache_shape,
    cached_visibility,
    check_cache_dtype,
    check_new_cache_dtype,
    row_positions,
    update_cache,
)
from mha_multi.spec.cache_checks import (
    SPAN_BUCKET,
    CacheFill,
    as_kv_cache,
    check_cache_dtypes,
    check_cache_values,
    check_cached_call,
    check_cached_inputs,
    rounded_span,
    window_first,
)
from mha_multi.spec.checks import (
    Heads,
    check_causal,
    check_config,
    check_flag,
    check_heads,
    check_input_sizes,
    check_inputs,
    check_sizes_known,
    check_valid_lens_dtype,
    check_valid_lens_shape,
    clip_integer_lens,
    heads_of_weights,
    lens_as_numpy,
    shard_heads,
)
from mha_multi.spec.layout import (
    grouped_to_heads,
    heads_to_grouped,
    transpose_grouped_output,
    transpose_grouped_queries,
    transpose_output,
    transpose_qkv,
)
from mha_multi.spec.norms import (
    QK_NORM_NAMES,
    QKNorm,
    check_qk_norm,
    normalize_qk,
    qk_norm_shapes,
    refuse_whole_norm,
    rms_gain,
    rms_norm,
    rms_norm_backward,
    rms_normalized,
)
from mha_multi.spec.ops import (
    ArrayOps,
    NamespaceOps,
    NumpyDtypes,
    NumpyOps,
    static_split_sizes,
)
from mha_multi.spec.options import (
    NO_OPTIONS,
    LayerOptions,
    ScoreOptions,
    alibi_slopes,
    check_alibi,
    check_bias,
    check_bias_kind,
    check_positions,
    check_positions_kind,
    check_softcap,
    check_window,
    positions_on_host,
)
from mha_multi.spec.pieces import CPU_PIECE_BYTES, batch_pieces, in_pieces
from mha_multi.spec.plan import (
    DEVICE_READ_SCORES,
    DEVICE_READ_TOTAL_SCORES,
    FUSED_SCORE_LIMIT,
    FusedKernel,
    KernelPlan,
    magnitude_limit,
    plan_kernel,
    plan_relations,
    reads_values,
    scores_within_limit,
)
from mha_multi.spec.positions import (
    adjust_scores,
    cache_positions,
    call_positions,
    distance_back,
    score_bias,
    visibility,
)
from mha_multi.spec.reference import (
    reference_cached_forward,
    reference_forward,
    reference_gradients,
)
from mha_multi.spec.rotary import (
    Llama3Scaling,
    Rotary,
    check_rotary,
    rotary_length,
    rotary_tables,
    rotate,
)
from mha_multi.spec.rotary_scaling import (
    DynamicScaling,
    LinearScaling,
    LongRopeScaling,
    YarnScaling,
)
from mha_multi.spec.segments import (
    PADDING_ID,
    check_segment_ids,
    check_segment_ids_kind,
    checked_segment_ids,
    cu_seqlens_from_segment_ids,
    int32_segment_ids,
    restarting_positions,
    segment_ids_from_cu_seqlens,
    segment_ids_from_lengths,
    segment_ids_from_position_ids,
    segment_positions,
    segment_runs,
    segment_visibility,
    split_segment_ids,
)
from mha_multi.spec.sinks import (
    check_sinks,
    sink_column,
    sink_logits_of,
    sink_softmax_backward,
    sink_weights,
    sinks_shape,
)

__all__ = [
    "CPU_PIECE_BYTES",
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
    "NamespaceOps",
    "NumpyDtypes",
    "NumpyOps",
    "apply_head_mask",
    "as_kv_cache",
    "attention",
    "attention_by_kv_heads",
    "cache_shape",
    "check_cache_dtypes",
    "check_new_cache_dtype",
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
    "check_flag",
    "check_inputs",
    "clip_integer_lens",
    "lens_as_numpy",
    "check_valid_lens_dtype",
    "check_valid_lens_shape",
    "is_low_precision",
    "magnitude_limit",
    "masked_softmax",
    "plan_kernel",
    "plan_relations",
    "positions_on_host",
    "reads_values",
    "scores_within_limit",
    "reference_cached_forward",
    "reference_forward",
    "reference_gradients",
    "rounded_span",
    "window_first",
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
    "DynamicScaling",
    "LinearScaling",
    "Llama3Scaling",
    "LongRopeScaling",
    "YarnScaling",
    "NO_OPTIONS",
    "Rotary",
    "ScoreOptions",
    "adjust_scores",
    "alibi_slopes",
    "cache_positions",
    "call_positions",
    "check_alibi",
    "check_bias",
    "check_bias_kind",
    "check_positions",
    "check_positions_kind",
    "check_rotary",
    "check_sinks",
    "check_softcap",
    "check_window",
    "distance_back",
    "rotary_length",
    "rotary_tables",
    "sink_column",
    "sink_logits_of",
    "sink_softmax_backward",
    "sink_weights",
    "sinks_shape",
    "rotate",
    "score_bias",
    "fix_fully_hidden_rows",
    "check_input_sizes",
    "check_cache_dtype",
    "cached_visibility",
    "appended",
    "row_positions",
    "QK_NORM_NAMES",
    "QKNorm",
    "check_qk_norm",
    "normalize_qk",
    "qk_norm_shapes",
    "refuse_whole_norm",
    "rms_gain",
    "rms_norm",
    "rms_norm_backward",
    "rms_normalized",
    "PADDING_ID",
    "check_segment_ids",
    "check_segment_ids_kind",
    "checked_segment_ids",
    "cu_seqlens_from_segment_ids",
    "restarting_positions",
    "segment_ids_from_cu_seqlens",
    "segment_ids_from_lengths",
    "segment_ids_from_position_ids",
    "segment_positions",
    "segment_runs",
    "segment_visibility",
    "split_segment_ids",
    "int32_segment_ids",
    "batch_pieces",
    "in_pieces",
]

# The values users keep (a cache, the rotary options) are named by their public
# path: pickles and the API pages refer to ``mha_multi.spec.KVCache``, which
# stays where it is whichever module of the package defines it.
for _public in (
    KVCache,
    Rotary,
    Llama3Scaling,
    LinearScaling,
    DynamicScaling,
    YarnScaling,
    LongRopeScaling,
    QKNorm,
):
    _public.__module__ = __name__
del _public
