"""A weight file of any registered format: which format it is, read and written by name.

Part of :mod:`mha_multi.interop.formats`: :func:`detect_format` tells a file's
format from its name (and its content, where several formats share the
name's ending); :func:`load` and :func:`save` call the format's reader and
writer, importing its framework only then.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mha_multi.interop.formats._head_layout import (
    _check_options,
    check_heads_given,
    resolve_heads,
)
from mha_multi.interop.formats._registry import FORMATS, RECOGNISERS, Format, _record

__all__ = ["detect_format", "load", "save", "suffix_formats"]


def _suffix(path: str | os.PathLike[str]) -> str | None:
    """The longest registered suffix that ends ``path``'s name (any case), or ``None``."""
    name = os.fspath(path).lower()
    matches = [s for record in FORMATS.values() for s in record.suffixes if name.endswith(s)]
    return max(matches, key=len, default=None)


def suffix_formats(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The names of the formats whose suffixes end ``path``'s name.

    Case does not matter; the longest matching suffix wins (``w.weights.h5``
    is ``keras-mha`` or ``keras-gqa`` even if a format claimed ``.h5``).

    Returns:
        Registry names, in registry order; empty when no suffix matches.
    """
    suffix = _suffix(path)
    return tuple(name for name, record in FORMATS.items() if suffix in record.suffixes)


def _function(target: str, label: str, record: Format | None) -> Callable[..., Any]:
    """The function at ``"module:function"``, importing ``record``'s framework.

    A missing framework is reported for ``label`` as ``record`` names it;
    with no ``record``, or one of no framework, the import error stays as it is.
    """
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if record is None or record.framework is None:
            raise
        raise ImportError(
            f"format {label} needs {record.framework}, which is not installed ({error}): "
            f"pip install 'mha_multi[{record.extra}]'"
        ) from error
    return getattr(module, attribute)


def detect_format(path: str | os.PathLike[str], *, reading: bool) -> str:
    """The registry name of the format of the file at ``path``.

    Args:
        path: the file.
        reading: ``True`` for an existing file to read: where several formats
            share its suffix, its content decides (the suffix's recogniser in
            :data:`RECOGNISERS`, which may import a framework and reads the
            file); ``False`` for a file to write, which gets the default
            format of its suffix.

    Raises:
        FileNotFoundError: reading, no file at ``path`` (where the content decides).
        ValueError: no format claims the suffix (or, reading, the content
            matches none of the formats that share it).
        ImportError: reading needs a framework that is not installed.
    """
    suffix = _suffix(path)
    if suffix is None:
        raise ValueError(
            f"cannot tell the format of {os.fspath(path)!r} from its name; pass --from/--to "
            f"(one of {', '.join(FORMATS)})"
        )
    names = suffix_formats(path)
    if len(names) == 1:
        return names[0]
    records = [FORMATS[n] for n in names]
    if not reading:
        return next(r.name for r in records if r.default)
    # A missing framework is named after every candidate: the one they share.
    shared = records[0] if len({r.framework for r in records}) == 1 else None
    recognise = _function(RECOGNISERS[suffix], "/".join(names), shared)
    name = recognise(os.fspath(path))
    if name not in names:
        raise ValueError(f"{os.fspath(path)!r} is none of the formats {', '.join(names)}")
    return name


def load(
    path: str | os.PathLike[str],
    format: str | None = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, np.ndarray]:
    """Canonical weights from a file of any registered format.

    Args:
        path: the file.
        format: a registry name; by default detected (:func:`detect_format`).
        num_heads, num_kv_heads, head_dim: the head layout, where known
            (:func:`resolve_heads`): checked against the file where it stores
            one, needed where it follows one it does not record (``llama``),
            and otherwise checked against the weights' widths.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: an unknown format, a file that is damaged or not of its
            format, weights that do not fit the canonical layer, or head
            options that are missing where needed or do not fit the file.
        ImportError: the format's framework is not installed.
    """
    options = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    _check_options(options)
    name = detect_format(path, reading=True) if format is None else _record(format).name
    record = FORMATS[name]
    check_heads_given(name, reading=True, **options)
    reader = _function(record.reader, name, record)
    if record.heads is not None:
        return reader(os.fspath(path), **options)
    weights = reader(os.fspath(path))
    resolve_heads(weights, source=path, **options)
    return weights


def save(
    path: str | os.PathLike[str],
    weights: Mapping[str, Any],
    format: str | None = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> None:
    """Writes canonical weights as a file of any registered format.

    Args:
        path: the destination.
        weights: canonical weights.
        format: a registry name; by default detected (:func:`detect_format`).
        num_heads, num_kv_heads, head_dim: the head layout (any one fixes it,
            :func:`resolve_heads`); needed by formats with a layout, and
            checked against the weights' widths.

    Raises:
        ValueError: an unknown format, a path whose name is no file name of
            the format, invalid weights, weights the format cannot express,
            or head options that are missing where needed or do not fit the
            weights.
        ImportError: the format's framework is not installed.
        OSError: the file cannot be written.
    """
    options = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    name = detect_format(path, reading=False) if format is None else _record(format).name
    record = FORMATS[name]
    if os.path.isdir(path):  # (each writer failed its own way: MXNet with a traceback)
        raise IsADirectoryError(f"{os.fspath(path)!r} is a directory, not a weights file")
    if _suffix(path) not in record.suffixes:
        # (A file named as another format's would be read back as that format.)
        raise ValueError(
            f"path must end in {' or '.join(record.suffixes)} for the {name} format; "
            f"got {os.fspath(path)!r}"
        )
    _check_options(options)
    check_heads_given(name, reading=False, **options)
    heads = resolve_heads(weights, **options)
    writer = _function(record.writer, name, record)
    if record.heads is None:
        writer(os.fspath(path), weights)
        return
    assert heads is not None  # check_heads_given
    writer(
        os.fspath(path),
        weights,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
    )
