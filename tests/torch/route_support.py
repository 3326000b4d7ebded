"""Spies on the PyTorch facts' fast route for plain self-attention (docs: "Fast paths")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from mha_multi import spec
from mha_multi.torch import _backend


@contextlib.contextmanager
def answered_calls() -> Iterator[list[bool]]:
    """Yields a list that gets, for each call the driver offers the fast route, whether
    the route answered it."""
    answers: list[bool] = []
    route = _backend.FACTS.plain_attention

    def spy(*args, **kwargs):
        result = route(*args, **kwargs)
        answers.append(result is not None)
        return result

    with mock.patch.object(_backend.FACTS, "plain_attention", spy):
        yield answers


def generic_only() -> contextlib.AbstractContextManager:
    """The fast route answering no call: every call takes the generic flow."""
    return mock.patch.object(_backend.FACTS, "plain_attention", return_value=None)


@contextlib.contextmanager
def as_if_on_a_gpu() -> Iterator[None]:
    """The facts told every tensor is on a GPU: nothing on the host (so no value is read
    below ``spec.DEVICE_READ_SCORES``) and a cache's span rounded up to
    ``spec.SPAN_BUCKET``, as they are for CUDA tensors."""
    facts = _backend.FACTS
    with (
        mock.patch.object(facts, "on_host", lambda q: False),
        mock.patch.object(facts, "span_bucket_of", lambda keys: spec.SPAN_BUCKET),
    ):
        yield
