"""Spies on the PyTorch facts' fast route for plain self-attention (docs: "Fast paths")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from mha_multi.parity.harness import torch as backend
from mha_multi.torch import _facts


@contextlib.contextmanager
def answered_calls() -> Iterator[list[bool]]:
    """Yields a list that gets, for each call the driver offers the fast route, whether
    the route answered it: a decoding step at the layer's door (``plain_step``), a call
    without a cache in its flow (``plain_attention``, which declines every step)."""
    answers: list[bool] = []
    route, step = _facts.FACTS.plain_attention, _facts.FACTS.plain_step

    def spy(*args, **kwargs):
        result = route(*args, **kwargs)
        if args[2] is None:  # (a step's offer is the door's)
            answers.append(result is not None)
        return result

    def step_spy(*args, **kwargs):
        result = step(*args, **kwargs)
        answers.append(result is not None)
        return result

    with (
        mock.patch.object(_facts.FACTS, "plain_attention", spy),
        mock.patch.object(_facts.FACTS, "plain_step", step_spy),
    ):
        yield answers


#: The fast route answering no call: every call takes the generic flow.
generic_only = backend.generic_flow_only


@contextlib.contextmanager
def answered_cross_calls() -> Iterator[list[bool]]:
    """Yields a list that gets, for each plain cross-attention call the driver offers the
    route (``cross_attention``), whether the route answered it."""
    answers: list[bool] = []
    route = _facts.FACTS.cross_attention

    def spy(*args, **kwargs):
        result = route(*args, **kwargs)
        answers.append(result is not None)
        return result

    with mock.patch.object(_facts.FACTS, "cross_attention", spy):
        yield answers
