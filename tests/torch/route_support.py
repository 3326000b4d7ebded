"""Spies on the PyTorch facts' fast route for plain self-attention (docs: "Fast paths")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from mha_multi.torch import _facts


@contextlib.contextmanager
def answered_calls() -> Iterator[list[bool]]:
    """Yields a list that gets, for each call the driver offers the fast route, whether
    the route answered it."""
    answers: list[bool] = []
    route = _facts.FACTS.plain_attention

    def spy(*args, **kwargs):
        result = route(*args, **kwargs)
        answers.append(result is not None)
        return result

    with mock.patch.object(_facts.FACTS, "plain_attention", spy):
        yield answers


def generic_only() -> contextlib.AbstractContextManager:
    """The fast route answering no call: every call takes the generic flow."""
    return mock.patch.object(_facts.FACTS, "plain_attention", return_value=None)
