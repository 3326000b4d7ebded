"""``convert MODEL_DIR OUT_DIR``: a checkpoint's attention layers written to a folder, and back.

:func:`convert_checkpoint` writes each attention layer of a transformers
checkpoint folder (:func:`mha_multi.interop.transformers.attention_layers`)
as a canonical ``layer_<index>.safetensors``, and :data:`MANIFEST` listing
the layers with their constructor arguments. :func:`converted_layers` reads
such a folder; :func:`write_back` writes its layers into a checkpoint's
files, in place of their attention entries (docs: "Porting weights").

Nothing is written on an error: the folder is written under a temporary name
and renamed at the end; a checkpoint's files are written anew beside the old
ones, which they replace once all are written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from mha_multi.interop.transformers import _SKIPPED, _checked_folder, _layers, attention_state
from mha_multi.weights import load_weights, save_weights

__all__ = ["MANIFEST", "convert_checkpoint", "converted_layers", "write_back"]

#: The converted folder's list of layers: ``{"model_type", "hidden_size",
#: "layers": [{"index", "weights", "kwargs"}, ...]}``.
MANIFEST = "attention.json"


class Progress:
    """``label done/total`` redrawn on one line of a terminal; nothing elsewhere."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.active = total > 0 and self.stream.isatty()
        self.label, self.total, self.done = label, total, 0
        self._draw()

    def step(self) -> None:
        self.done += 1
        self._draw()
        if self.done == self.total and self.active:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        if self.active:
            filled = 30 * self.done // self.total
            bar = "#" * filled + "." * (30 - filled)
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total}")
            self.stream.flush()


def convert_checkpoint(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    layers: Iterable[int] | None = None,
    progress: TextIO | None = None,
) -> list[int]:
    """Writes a checkpoint folder's attention layers to ``out_dir``; returns their indices.

    Args:
        model_dir: a transformers checkpoint folder.
        out_dir: a folder that does not exist yet, or an empty one.
        layers: the layers' indices; every layer by default.
        progress: where a progress bar goes when it is a terminal (stderr by default).

    Raises:
        As :func:`~mha_multi.interop.transformers.attention_layers`, and
        ``FileExistsError`` for an ``out_dir`` that holds files.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{os.fspath(out)!r} exists and is not an empty folder")
    folder, config, prefixes = _checked_folder(model_dir, layers)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"no such directory: {os.fspath(out.parent)!r}")
    temporary = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    manifest: dict[str, Any] = {
        "model_type": config.model_type,
        "hidden_size": int(config.hidden_size),
        "layers": [],
    }
    try:
        bar = Progress("converting layers", len(prefixes), progress)
        for index, weights, kwargs in _layers(folder, config, prefixes):
            name = f"layer_{index}.safetensors"
            save_weights(temporary / name, weights)
            manifest["layers"].append({"index": index, "weights": name, "kwargs": kwargs})
            bar.step()
        (temporary / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            out.rmdir()
        temporary.rename(out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return list(prefixes)


def converted_layers(
    out_dir: str | os.PathLike[str],
) -> Iterator[tuple[int, dict[str, np.ndarray], dict[str, Any]]]:
    """``(index, weights, kwargs)`` of each layer of a folder :func:`convert_checkpoint` wrote.

    Raises:
        FileNotFoundError: no :data:`MANIFEST` or layer file.
        ValueError: a manifest or a file that cannot be read.
    """
    for entry in _manifest(Path(out_dir))["layers"]:
        weights = load_weights(Path(out_dir) / entry["weights"])
        yield int(entry["index"]), weights, dict(entry["kwargs"])


def _manifest(out: Path) -> dict[str, Any]:
    path = out / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{os.fspath(out)!r} has no {MANIFEST} (a converted folder's)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(
            f"{os.fspath(path)!r} is not a converted folder's manifest: {error}"
        ) from error
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise ValueError(f"{os.fspath(path)!r} is not a converted folder's manifest: {problem}")
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    """What a manifest lacks of :data:`MANIFEST`'s form, in words; ``None`` where nothing.

    Each layer's ``weights`` must name a file of the folder itself: a manifest
    read back is a file like any other, which may have been edited.
    """
    if not isinstance(manifest, dict):
        return "it is no JSON object"
    if not isinstance(manifest.get("model_type"), str):
        return "its model_type is no string"
    layers = manifest.get("layers")
    if not isinstance(layers, list):
        return "its layers are no list"
    for position, entry in enumerate(layers):
        if not (
            isinstance(entry, dict)
            and type(entry.get("index")) is int
            and isinstance(entry.get("weights"), str)
            and isinstance(entry.get("kwargs"), dict)
        ):
            return f"its layers[{position}] is not {{'index': int, 'weights': str, 'kwargs': dict}}"
        name = entry["weights"]
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            return f"layer {entry['index']}'s weights {name!r} is no file name of the folder"
    indices = [entry["index"] for entry in layers]
    if len(set(indices)) != len(indices):
        return "it lists a layer twice"
    return None


def is_converted(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder :func:`convert_checkpoint` wrote."""
    return (Path(path) / MANIFEST).exists()


def write_back(
    converted_dir: str | os.PathLike[str], model_dir: str | os.PathLike[str], **options: Any
) -> list[int]:
    """Writes a converted folder's layers into a checkpoint's files; returns their indices.

    Each layer's canonical weights become the checkpoint's attention entries
    of that layer (in their dtype and files); every other entry is kept.

    Args:
        converted_dir: a folder :func:`convert_checkpoint` wrote.
        model_dir: a checkpoint folder of the same model type and shapes.
        options: ``layers``, the layers' indices (all the converted folder's
            by default), and ``progress``, as for :func:`convert_checkpoint`.

    Raises:
        FileNotFoundError: a folder or a file missing.
        ValueError: another model type, a layer the folder lacks, or weights
            whose entries or shapes are not the checkpoint's; nothing is
            written then.
    """
    entries = {int(entry["index"]): entry for entry in _manifest(Path(converted_dir))["layers"]}
    layers = options.get("layers")
    indices = list(entries) if layers is None else [int(i) for i in layers]
    missing = [index for index in indices if index not in entries]
    if missing:
        raise ValueError(f"{os.fspath(converted_dir)!r} has no layer {missing[0]}")
    folder, config, prefixes = _checked_folder(model_dir, indices)
    manifest_type = _manifest(Path(converted_dir))["model_type"]
    if manifest_type != config.model_type:
        raise ValueError(
            f"the layers are of model_type {manifest_type!r}; the checkpoint's is "
            f"{config.model_type!r}"
        )
    replacements: dict[str, np.ndarray] = {}
    bar = Progress("writing layers", len(indices), options.get("progress"))
    for index in indices:
        weights = load_weights(Path(converted_dir) / entries[index]["weights"])
        state = attention_state(config, index, weights, prefixes[index])
        present = {name for name in folder.entries if name.startswith(prefixes[index])}
        present = {name for name in present if not name.endswith(_SKIPPED)}
        if set(state) != present:
            raise ValueError(
                f"layer {index}: the checkpoint has the entries {sorted(present)}; the "
                f"weights give {sorted(state)}"
            )
        replacements.update(state)
        bar.step()
    written = folder.rewrite(replacements)
    for new, old in written:
        os.replace(new, old)
    return indices


def convert_folder(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    layers: Iterable[int] | None = None,
) -> str:
    """The command's folder conversion, either way; returns what it did, in words.

    A ``source`` holding :data:`MANIFEST` is written back into the checkpoint
    ``destination``; any other is a checkpoint converted into ``destination``.
    """
    if is_converted(source):
        done = write_back(source, destination, layers=layers)
        return f"{len(done)} attention layers written into {os.fspath(destination)}"
    done = convert_checkpoint(source, destination, layers=layers)
    return f"{len(done)} attention layers written to {os.fspath(destination)}/{MANIFEST}"
