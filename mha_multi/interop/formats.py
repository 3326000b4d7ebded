"""The weight-file formats: one registry, read and written by name.

:data:`FORMATS` maps each format's name (what ``python -m mha_multi convert
--from/--to`` takes) to a :class:`Format` record: what it is, the file names
that mean it, the framework it needs, and where its reader and writer live.
Readers and writers are named by import path and imported on first use, so
importing this module imports no framework.

A file name ending shared by several formats (``.pt``: ``torch-mha`` and
``torch-d2l``) is resolved by the file's content when reading (the formats'
``recogniser``) and by the one ``default`` format among them when writing.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = [
    "FORMATS",
    "Format",
    "detect_format",
    "load",
    "save",
    "suffix_formats",
]


@dataclass(frozen=True)
class Format:
    """A weight-file format of the registry.

    Attributes:
        name: the registry key, as ``--from``/``--to`` take it (``torch-mha``).
        description: one line saying what the file holds.
        suffixes: lower-case endings of the file names that mean this format.
        reader: ``"module:function"``; the function takes ``(path)`` (and
            ``num_heads=`` when :attr:`num_heads`) and returns canonical weights.
        writer: ``"module:function"``; the function takes ``(path, weights)``
            (and ``num_heads=`` when :attr:`num_heads`).
        framework: what the reader and writer import, as users know it
            (``"PyTorch"``); ``None`` for numpy alone.
        extra: the ``mha_multi[...]`` extra that installs the framework.
        num_heads: the file stores heads separately: the writer needs
            ``num_heads`` and the reader checks it against the file.
        default: written for a file name that several formats share.
        recogniser: ``"module:function"`` telling, from the content of a file
            whose name several formats share, which of them it is
            (``function(path) -> name``).
    """

    name: str
    description: str
    suffixes: tuple[str, ...]
    reader: str
    writer: str
    framework: str | None = None
    extra: str | None = None
    num_heads: bool = False
    default: bool = True
    recogniser: str | None = None


_TORCH = "mha_multi.interop.torch"

#: Format name -> record, in the order help and error messages list them.
FORMATS: Mapping[str, Format] = MappingProxyType(
    {
        record.name: record
        for record in (
            Format(
                name="canonical",
                description="canonical weights (.npz read with allow_pickle=False)",
                suffixes=(".npz", ".safetensors"),
                reader="mha_multi.weights:load_weights",
                writer="mha_multi.weights:save_weights",
            ),
            Format(
                name="torch-mha",
                description="state_dict of torch.nn.MultiheadAttention",
                suffixes=(".pt", ".pth"),
                reader=f"{_TORCH}:load_torch_mha",
                writer=f"{_TORCH}:save_torch_mha",
                framework="PyTorch",
                extra="torch",
                default=False,
                recogniser=f"{_TORCH}:checkpoint_format",
            ),
            Format(
                name="torch-d2l",
                description="state_dict of d2l's torch MultiHeadAttention (also mha_multi.torch's)",
                suffixes=(".pt", ".pth"),
                reader=f"{_TORCH}:load_torch_d2l",
                writer=f"{_TORCH}:save_torch_d2l",
                framework="PyTorch",
                extra="torch",
                recogniser=f"{_TORCH}:checkpoint_format",
            ),
            Format(
                name="mxnet-d2l",
                description="Gluon parameters of d2l's MXNet MultiHeadAttention "
                "(also mha_multi.mxnet's), as save_parameters writes them",
                suffixes=(".params",),
                reader="mha_multi.interop.mxnet:load_mxnet_d2l",
                writer="mha_multi.interop.mxnet:save_mxnet_d2l",
                framework="MXNet",
                extra="mxnet",
            ),
            Format(
                name="keras-mha",
                description="Keras save_weights of a model holding one "
                "keras.layers.MultiHeadAttention",
                suffixes=(".weights.h5",),
                reader="mha_multi.interop.keras:load_keras_mha",
                writer="mha_multi.interop.keras:save_keras_mha",
                framework="Keras",
                extra="keras",
                num_heads=True,
            ),
        )
    }
)


def _record(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; expected one of {', '.join(FORMATS)}") from None


def suffix_formats(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The names of the formats whose suffixes end ``path``'s name.

    Case does not matter; the longest matching suffix wins (``w.weights.h5``
    is ``keras-mha`` even if a format claimed ``.h5``).

    Returns:
        Registry names, in registry order; empty when no suffix matches.
    """
    name = os.fspath(path).lower()
    lengths = {
        record.name: max((len(s) for s in record.suffixes if name.endswith(s)), default=0)
        for record in FORMATS.values()
    }
    longest = max(lengths.values())
    return tuple(n for n, length in lengths.items() if length and length == longest)


def _function(target: str, label: str, record: Format) -> Callable[..., Any]:
    """The function at ``"module:function"``, importing its framework."""
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if record.framework is None:
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
            share its suffix, its content decides (which imports their
            framework and reads the file); ``False`` for a file to write,
            which gets the default format of its suffix.

    Raises:
        ValueError: no format claims the suffix (or, reading, the content
            matches none of the formats that share it).
        ImportError: reading needs a framework that is not installed.
    """
    names = suffix_formats(path)
    if not names:
        raise ValueError(
            f"cannot tell the format of {os.fspath(path)!r} from its name; pass --from/--to "
            f"(one of {', '.join(FORMATS)})"
        )
    if len(names) == 1:
        return names[0]
    records = [FORMATS[n] for n in names]
    if not reading:
        return next(r.name for r in records if r.default)
    first = records[0]
    assert first.recogniser is not None, f"formats {names} share a suffix but no recogniser"
    recognise = _function(first.recogniser, "/".join(names), first)
    name = recognise(os.fspath(path))
    if name not in names:
        raise ValueError(f"{os.fspath(path)!r} is none of the formats {', '.join(names)}")
    return name


def load(
    path: str | os.PathLike[str], format: str | None = None, *, num_heads: int | None = None
) -> dict[str, np.ndarray]:
    """Canonical weights from a file of any registered format.

    Args:
        path: the file.
        format: a registry name; by default detected (:func:`detect_format`).
        num_heads: checked against the file where the format stores heads.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: an unknown format, a file that is damaged or not of its
            format, or weights that do not fit the canonical layer.
        ImportError: the format's framework is not installed.
    """
    name = detect_format(path, reading=True) if format is None else _record(format).name
    record = FORMATS[name]
    reader = _function(record.reader, name, record)
    options = {"num_heads": num_heads} if record.num_heads else {}
    return reader(os.fspath(path), **options)


def save(
    path: str | os.PathLike[str],
    weights: Mapping[str, Any],
    format: str | None = None,
    *,
    num_heads: int | None = None,
) -> None:
    """Writes canonical weights as a file of any registered format.

    Args:
        path: the destination.
        weights: canonical weights.
        format: a registry name; by default detected (:func:`detect_format`).
        num_heads: needed by formats that store heads separately.

    Raises:
        ValueError: an unknown format, invalid weights, weights the format
            cannot express, or a missing ``num_heads`` that the format needs.
        ImportError: the format's framework is not installed.
        OSError: the file cannot be written.
    """
    name = detect_format(path, reading=False) if format is None else _record(format).name
    record = FORMATS[name]
    if record.num_heads and num_heads is None:
        raise ValueError(f"writing {name} needs num_heads (the kernels are per head)")
    writer = _function(record.writer, name, record)
    options = {"num_heads": num_heads} if record.num_heads else {}
    writer(os.fspath(path), weights, **options)
