"""What a call's shapes and flags decide, made once per signature: its checks' verdicts and
its kernel plans.

The spec's checks (:func:`mha_multi.spec.check_inputs`,
:func:`mha_multi.spec.check_cached_call`) and its kernel plan
(:func:`mha_multi.spec.plan_kernel`) are pure functions of a call's shapes,
dtypes and flags, so every call of a signature after the first looks their
answer up here: a small call's fixed cost is mostly such Python work (docs:
"Fast paths"). Each caller names what its function reads, the signature of
the call for that decision, and :func:`once_per_signature` keeps the answer
in one table of the call's decisions.

A decision that raises keeps nothing: the next call of that signature raises
again. A key that cannot be hashed (a traced size, an array given for a flag)
decides anew each time. A
framework whose tracer must see the checks run (``torch.compile``'s would
guard on the table) says when it runs (:attr:`Facts.tracing`), and then
nothing is kept or looked up.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from mha_multi.call.facts import Facts
from mha_multi.spec.memo import Kept

__all__ = ["DECISIONS", "KEPT_DECISIONS", "forget", "once_per_signature"]

T = TypeVar("T")

#: How many signatures' decisions are kept, the least recently made dropped first.
KEPT_DECISIONS = 4096

#: The decisions, by ``(decide, key)`` (:func:`once_per_signature`), and the kernel
#: plans' part that shapes and flags decide (:func:`mha_multi.call.plan`).
DECISIONS: Kept[Any] = Kept(KEPT_DECISIONS)


def forget() -> None:
    """Drops every kept decision."""
    DECISIONS.clear()


def once_per_signature(
    facts: Facts, decide: Callable[..., T], key: Hashable, *args: Any, **kwargs: Any
) -> T:
    """``decide(*args, **kwargs)``, made by the first call of ``key`` and kept for the
    calls after it.

    Args:
        facts: the framework's facts, which say whether decisions are kept now
            (:attr:`Facts.tracing`).
        decide: a pure function of what ``key`` names (a spec's check or plan).
        key: the call's signature for ``decide``: everything of ``args`` and
            ``kwargs`` that ``decide`` reads, or how it compares them (a plan's
            sizes by :func:`mha_multi.spec.plan_relations`).
    """
    tracing = facts.tracing
    if tracing is not None and tracing():
        return decide(*args, **kwargs)
    signature = (decide, key)
    try:
        return DECISIONS[signature]
    except KeyError:
        pass
    except (TypeError, NotImplementedError):  # (no hash: MXNet's arrays raise the second)
        return decide(*args, **kwargs)
    return DECISIONS.keep(signature, decide(*args, **kwargs))
