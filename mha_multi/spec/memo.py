"""Pure checks and plans computed once per arguments: a call's verdicts as lookups.

A call's checks and plan depend on shapes and flags alone, so every call of a
layer after the first with the same shapes can be a lookup: a small call's
fixed cost is mostly such Python work. A tracer that must see the function
run (``torch.compile``'s warns about every ``functools.lru_cache`` it passes
through) is named by the framework's facts, never looked for here
(:func:`skip_while`): the spec knows no framework.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["decided_once", "skip_while"]

#: Predicates, each supplied by a framework's facts, true while its tracer runs.
_TRACING: tuple[Callable[[], bool], ...] = ()


def skip_while(tracing: Callable[[], bool]) -> None:
    """Computes :func:`decided_once` functions anew while ``tracing()`` is true.

    Called once by a framework's facts when imported; the same predicate
    given twice is kept once.
    """
    global _TRACING
    if tracing not in _TRACING:
        _TRACING = (*_TRACING, tracing)


def decided_once(
    function: Callable[..., Any] | None = None,
    *,
    canonical: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Any:
    """``function`` (pure), computed once per arguments where they can be hashed.

    A call that raises is not remembered (it raises again); ``typed`` keeps
    ``True`` and ``1`` apart. Arguments that cannot be hashed (arrays, some
    traced sizes) are worked out each time. ``canonical`` maps the keyword
    arguments to ones with the same result, fewer in kind (a decoding step's
    growing sizes to how they compare), so that more calls are lookups.
    """
    if function is None:
        return functools.partial(decided_once, canonical=canonical)
    once = functools.lru_cache(maxsize=4096, typed=True)(function)

    @functools.wraps(function)
    def decided(*args: Any, **kwargs: Any) -> Any:
        for tracing in _TRACING:
            if tracing():
                return function(*args, **kwargs)  # a graph is traced once anyway
        if canonical is not None:
            kwargs = canonical(kwargs)
        try:
            return once(*args, **kwargs)
        except Exception:
            # Unhashable arguments (TypeError, or MXNet arrays'
            # NotImplementedError), or the function's own error: computed
            # again outside this handler, it raises that error on its own
            # (nothing failing is remembered).
            pass
        return function(*args, **kwargs)

    return decided
