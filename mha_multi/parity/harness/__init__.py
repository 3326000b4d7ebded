"""What every framework's harness shares: the record of a fused kernel's call, and the facts.

A harness (``mha_multi.parity.harness.<framework>``) drives one framework's
layer for the parity runners, the benchmark and the tests: it builds the
layer, calls it, takes its gradients, spies on its fused kernel and builds
the framework's own layer (docs: "Architecture"). It stands above the
framework's package and imports it; nothing in the package imports the
harness. This module, below both the harnesses and the runners
(:mod:`mha_multi.parity.runners`), imports no framework.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

__all__ = ["KernelCall", "facts_passthrough"]


class KernelCall(NamedTuple):
    """What one call of a backend's fused kernel was given."""

    mask: bool
    """Whether a boolean mask was passed."""
    is_causal: bool
    """The kernel's own causal flag."""
    key_lengths: np.ndarray | None = None
    """Per-example key lengths, where the kernel takes them."""
    dropout: float = 0.0
    """The kernel's dropout rate."""


def facts_passthrough(harness: str, facts: ModuleType) -> Callable[[str], Any]:
    """A harness module's ``__getattr__`` (PEP 562) that answers with its framework's facts.

    A harness drives layers; its callers (runners, benchmarks, tests) also
    convert arrays, pick devices and sync, which the framework's facts
    module does. With this as its ``__getattr__``, ``harness.to_numpy`` and
    the other public names of the facts module are read through the
    harness, which lists only its own.

    Args:
        harness: the harness module's ``__name__``, for the error message.
        facts: the framework's facts module (``mha_multi.<framework>._facts``).

    Returns:
        The ``__getattr__`` to bind in the harness module.
    """

    def facts_name(name: str) -> Any:
        if name in facts.__all__:
            return getattr(facts, name)
        raise AttributeError(f"module {harness!r} has no attribute {name!r}")

    return facts_name
