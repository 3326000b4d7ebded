"""The head layout of weight files: the options that fix it, checked against weights and files.

Part of :mod:`mha_multi.interop.formats`, which says why the layout is an
option: canonical weights do not record it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha_multi import spec
from mha_multi.interop.formats._registry import _record
from mha_multi.weights import check_weights

__all__ = ["check_heads_given", "check_stored_heads", "resolve_heads"]

#: The command line's name of each head option, which messages use.
_FLAGS = {"num_heads": "--num-heads", "num_kv_heads": "--num-kv-heads", "head_dim": "--head-dim"}


def _check_options(options: Mapping[str, Any]) -> dict[str, int]:
    """The head options that were given, checked to be positive ints."""
    given = {}
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{_FLAGS[name]} must be a positive integer; got {value!r}")
        if value < 1:
            raise ValueError(f"{_FLAGS[name]} must be a positive integer; got {value}")
        given[name] = int(value)
    return given


def resolve_heads(
    weights: Mapping[str, Any],
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    source: str | os.PathLike[str] | None = None,
) -> spec.Heads | None:
    """The head layout of canonical weights that the options given fix.

    ``W_q`` has ``num_heads * head_dim`` columns and ``W_k`` ``num_kv_heads *
    head_dim``, so any one option fixes the layout: ``head_dim`` comes from
    ``num_heads`` if given, else from ``head_dim``, else from
    ``num_kv_heads``; the others given are checked against it. Messages name
    the options as the command line does (``--num-heads``).

    Args:
        weights: canonical weights.
        num_heads, num_kv_heads, head_dim: the options; ``None`` where not given.
        source: the file the weights come from, for messages.

    Returns:
        The layout, or ``None`` when no option is given.

    Raises:
        ValueError: an option that is not a positive integer, that does not
            divide the width it counts, or that disagrees with another; or
            invalid weights.
    """
    given = _check_options(
        {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    )
    if not given:
        return None
    _, config = check_weights(weights, qk_norm=None, sinks=None)
    where = "" if source is None else f" of {os.fspath(source)!r}"
    query, kv, hidden = config.query_features, config.kv_features, config.num_hiddens
    assert query is not None and kv is not None  # check_weights reads them from the kernels
    if num_heads is not None:
        if query % num_heads:
            if query == hidden:  # d2l's layout: the message the command has always given
                raise ValueError(
                    f"num_hiddens ({hidden}){where} is not divisible by --num-heads ({num_heads})"
                )
            raise ValueError(
                f"the query projection{where} has {query} features (num_heads * head_dim), "
                f"which --num-heads ({num_heads}) does not divide"
            )
        dim, basis = query // num_heads, f"--num-heads {num_heads}"
    elif head_dim is not None:
        dim, basis = head_dim, f"--head-dim {head_dim}"
    else:
        assert num_kv_heads is not None
        if kv % num_kv_heads:
            raise ValueError(
                f"the key and value projections{where} have {kv} features (num_kv_heads * "
                f"head_dim), which --num-kv-heads ({num_kv_heads}) does not divide"
            )
        dim, basis = kv // num_kv_heads, f"--num-kv-heads {num_kv_heads}"
    for projection, features in (
        ("query projection has", query),
        ("key and value projections have", kv),
    ):
        if features % dim:
            noun, verb = projection.rsplit(" ", 1)
            raise ValueError(
                f"the {noun}{where} {verb} {features} features, no whole number of heads of "
                f"head_dim {dim} (given {basis})"
            )
    layout = {"num_heads": query // dim, "num_kv_heads": kv // dim, "head_dim": dim}
    for name, value in given.items():
        if value != layout[name]:
            raise ValueError(
                f"{_FLAGS[name]} {value} does not match the weights{where}: given {basis}, "
                f"their query projection ({query} features) holds {layout['num_heads']} heads "
                f"of head_dim {dim} and their key and value projections ({kv} features) "
                f"{layout['num_kv_heads']} key/value heads"
            )
    try:
        heads = spec.check_heads(
            hidden, layout["num_heads"], num_kv_heads=layout["num_kv_heads"], head_dim=dim
        )
        # The sinks (one a head) and per-head norms (of head_dim) fix the layout too.
        check_weights(weights, num_hiddens=hidden, qk_norm=None, sinks=None, **layout)
    except ValueError as error:
        raise ValueError(
            f"the weights{where} have no head layout given {basis}: {error}"
        ) from error
    return heads


def check_stored_heads(
    stored: spec.Heads,
    path: str | os.PathLike[str],
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    detail: str = "",
) -> None:
    """Checks the head options given against the layout a file stores.

    Args:
        stored: the file's layout.
        path: the file, for messages.
        num_heads, num_kv_heads, head_dim: the options; ``None`` where not given.
        detail: appended to the message (`` (query kernel shape ...)``).

    Raises:
        ValueError: an option that is not a positive integer or differs from
            the file's, named as the command line names it.
    """
    given = _check_options(
        {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    )
    stored_as = {
        "num_heads": f"the {stored.num_heads} heads",
        "num_kv_heads": f"the {stored.num_kv_heads} key/value heads",
        "head_dim": f"the head_dim {stored.head_dim}",
    }
    for name, value in given.items():
        if value != getattr(stored, name):
            raise ValueError(
                f"{_FLAGS[name]} {value} does not match {stored_as[name]} stored in "
                f"{os.fspath(path)!r}{detail}"
            )


def check_heads_given(
    name: str,
    *,
    reading: bool,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> None:
    """Raises ``ValueError`` when format ``name`` needs a head layout and no option gives one.

    Args:
        name: a registry name.
        reading: whether the file is read (``False``: written).
        num_heads, num_kv_heads, head_dim: the options; ``None`` where not given.
    """
    record = _record(name)
    needed = record.heads == "required" or (record.heads == "stored" and not reading)
    if not needed or any(v is not None for v in (num_heads, num_kv_heads, head_dim)):
        return
    why = (
        "the kernels are per head"
        if record.heads == "stored"
        else f"a {name} file does not record its head layout, which its shapes must fit"
    )
    action = "reading" if reading else "writing"
    raise ValueError(f"{action} {name} needs --num-heads (or --num-kv-heads or --head-dim): {why}")
