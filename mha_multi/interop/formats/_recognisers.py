"""Formats told apart by content without a framework: Llama-style names, a safetensors header.

Part of :mod:`mha_multi.interop.formats`, whose
:data:`~mha_multi.interop.formats.RECOGNISERS` names the recognisers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from mha_multi.interop.fused_projections import FUSED_PROJECTIONS

__all__ = ["llama_prefixes", "safetensors_format"]

#: The entry names of a Llama-style attention block that hold its query
#: projection: one of them every such block has (separate, or fused).
_LLAMA_QUERY = (
    "q_proj.weight",
    *sorted(
        {f"{fused.module}.weight" for fused in FUSED_PROJECTIONS.values() if "q" in fused.parts}
    ),
)


def llama_prefixes(names: Iterable[str]) -> list[str]:
    """The prefixes under which ``names`` hold a Llama-style attention block.

    A block is recognised by its ``q_proj.weight`` (or a fused module's that
    holds the query, Phi-3's ``qkv_proj.weight``), bare or under a prefix
    ending in ``.`` (``self_attn.``, ``model.layers.0.self_attn.``).

    Returns:
        The prefixes, sorted; empty when ``names`` hold no such block.
    """
    prefixes = set()
    for name in map(str, names):
        for query in _LLAMA_QUERY:
            if name.endswith(query):
                prefix = name[: -len(query)]
                if prefix == "" or prefix.endswith("."):
                    prefixes.add(prefix)
    return sorted(prefixes)


def safetensors_format(path: str | os.PathLike[str]) -> str:
    """Which format a ``.safetensors`` file holds: ``"llama"`` or ``"canonical"``.

    Only the header is read (tensor names), with no framework. A Llama-style
    attention block's names (:func:`llama_prefixes`) mean ``llama``; anything
    else, a damaged file included, is taken for ``canonical``, whose reader
    then checks it and says what is wrong.

    Raises:
        OSError: the file cannot be opened (``FileNotFoundError`` when there is none).
    """
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    with open(path, "rb"):  # a missing or unreadable file keeps its usual OSError
        pass
    try:
        with safe_open(path, framework="numpy") as file:
            names = list(file.keys())
    except SafetensorError:
        return "canonical"
    return "llama" if llama_prefixes(names) else "canonical"
