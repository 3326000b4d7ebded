"""The layer's call, written once: checks, plan, cache, attend, gates, output.

Every backend's layer is a shell around :func:`forward` (docs:
"Architecture"): it owns its parameters and its framework's module protocol,
and hands each call here together with two objects.

* The framework's :class:`Facts` (a subclass in
  ``mha_multi/<framework>/_facts.py``): how its arrays are checked and
  converted, which values can be read on the host and when, its array-ops
  adapter, and its fused kernel. Eager and compiled execution differ only in
  what :meth:`Facts.read` can read.
* The layer's :class:`Projections`: its head layout and input sizes, the
  input projections and the output projection of the gated context.

The math is :mod:`mha_multi.spec`'s; the flow of a call is here and nowhere
else, so a new option of the attention is added to the spec, to this package,
and to those fused kernels that can take it. One job per module:
:mod:`~mha_multi.call.contract` (the layer's side and the result),
:mod:`~mha_multi.call.facts` (the framework's side), :mod:`~mha_multi.call.checks`,
:mod:`~mha_multi.call.kernel_plan`, :mod:`~mha_multi.call.decisions` (what the
checks and the plan decide, kept per signature),
:mod:`~mha_multi.call.rotary_tables` (a call's tables at the default positions,
kept for later eager calls) and :mod:`~mha_multi.call.flow`.

Nothing here imports a framework.
"""

from __future__ import annotations

from mha_multi.call.checks import (
    check_cache_values,
    check_cached_call,
    check_call,
    check_gates,
    check_options,
    host_bias,
    host_positions,
    host_segment_ids,
)
from mha_multi.call.contract import (
    BIAS_SHAPE,
    GATES_SHAPE,
    INPUT_NAMES,
    Projections,
    Result,
    all_arrays_of,
    array_signature,
)
from mha_multi.call.facts import FACTS_MODULE_NAMES, Facts, read_all
from mha_multi.call.flow import (
    attend,
    attended_positions,
    binding_window,
    forward,
    plain_cross_attention,
    plain_self_attention,
)
from mha_multi.call.kernel_plan import decided, kernel_settings, plan, unread_plan

__all__ = [
    "BIAS_SHAPE",
    "FACTS_MODULE_NAMES",
    "GATES_SHAPE",
    "INPUT_NAMES",
    "Facts",
    "Projections",
    "Result",
    "all_arrays_of",
    "array_signature",
    "attend",
    "attended_positions",
    "binding_window",
    "check_cache_values",
    "check_cached_call",
    "check_call",
    "check_gates",
    "check_options",
    "host_bias",
    "host_positions",
    "host_segment_ids",
    "decided",
    "forward",
    "kernel_settings",
    "plain_cross_attention",
    "plain_self_attention",
    "plan",
    "read_all",
    "unread_plan",
]
