"""Objects made on first use, not at import, and kept: each Keras backend's facts and operations.

Not at import: the documentation imports the layer's modules against mocked
frameworks, where there is no backend to look up. Not ``functools.cache``:
``torch.compile`` traces through its wrapper, warning at every compilation
of a layer's call on Keras' PyTorch backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

__all__ = ["made_on_first_use"]

T = TypeVar("T")


def made_on_first_use(make: Callable[[], T]) -> Callable[[], T]:
    """A function of no argument returning ``make()``, made at its first call and kept."""
    made: list[T] = []

    @functools.wraps(make)
    def get() -> T:
        if not made:
            made.append(make())
        return made[0]

    return get
