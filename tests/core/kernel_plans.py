"""Made-up fused kernels and a call's facts, for the tests of :func:`spec.plan_kernel`.

Each kernel is like a backend's, with just the capabilities whose rules a
test works out by hand from docs "Fast paths".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mha_multi import spec

#: Adds ``-inf`` to hidden scores and applies its own dropout, like PyTorch's SDPA.
SDPA_LIKE = spec.FusedKernel("adds -inf, takes dropout", takes_dropout=True)
#: Replaces hidden scores, takes key lengths and a mask beside its causal flag, like XLA's.
XLA_LIKE = spec.FusedKernel(
    "replaces, key lengths, mask with causal",
    takes_key_lengths=True,
    mask_and_causal=True,
    replaces_hidden_scores=True,
)
#: Replaces hidden scores by ``MASK_VALUE`` (uniform hidden rows), no causal flag.
UNIFORM = spec.FusedKernel(
    "replaces by MASK_VALUE, no causal flag",
    causal_flag=False,
    replaces_hidden_scores=True,
    hidden_rows_uniform=True,
)
#: :data:`UNIFORM` applying its own dropout, like MXNet's ``SequenceMask`` route.
MASK_ONLY = dataclasses.replace(UNIFORM, takes_dropout=True)

# Kernels that take the positions and biases options too.
SDPA_WITH_BIAS = dataclasses.replace(SDPA_LIKE, name="adds -inf, float bias", takes_bias=True)
WINDOWED = dataclasses.replace(
    XLA_LIKE,
    name="replaces, key lengths, mask with causal, bias, window",
    takes_bias=True,
    takes_window=True,
)
SOFTCAPPED = spec.FusedKernel("softcap", takes_softcap=True)

#: A call's facts where a case does not say otherwise: no lengths, ``Q == K``,
#: values read and exact.
DEFAULT_FACTS: Mapping[str, Any] = {"sizes": (2, 4, 4), "lens_ndim": None, "values_exact": True}

#: The plan's fields that say where each rule goes.
FIELDS = (
    "is_causal",
    "key_lengths",
    "mask_lens",
    "mask_causal",
    "fix_rows",
    "fix_causal",
    "window_flag",
    "mask_window",
    "fix_window",
    "bias",
    "softcap",
)


def plan_of(kernel: spec.FusedKernel, facts: Mapping[str, Any]) -> spec.KernelPlan:
    """The kernel's plan for a call of :data:`DEFAULT_FACTS` updated by ``facts``."""
    return spec.plan_kernel(kernel, **{**DEFAULT_FACTS, **facts})


def assert_fused(kernel: spec.FusedKernel, facts: Mapping[str, Any], fields: set[str]) -> None:
    """The call runs the kernel, the plan setting exactly ``fields`` of :data:`FIELDS`."""
    plan = plan_of(kernel, facts)
    assert plan.fused, plan.reason
    planned = {field for field in FIELDS if getattr(plan, field)}
    assert planned == fields, planned


def assert_generic(kernel: spec.FusedKernel, facts: Mapping[str, Any], reason: str = "") -> None:
    """The call takes the generic path, for a reason that says ``reason``."""
    plan = plan_of(kernel, facts)
    assert not plan.fused and plan.reason and reason in plan.reason, plan.reason
