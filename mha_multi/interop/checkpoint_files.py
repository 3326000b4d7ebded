"""The files of a transformers checkpoint folder, read one tensor at a time with numpy alone.

A folder written by transformers' ``save_pretrained`` holds ``config.json``
and the weights: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (its ``weight_map``: tensor name -> file).
:class:`CheckpointFolder` reads the config and the shards' headers when it is
made (so a missing shard or a damaged header is reported before anything is
read or written), and then one tensor at a time, from its bytes in the file:
a whole model is never in memory (docs: "Porting weights").

The safetensors format is read and written here rather than through
``safetensors.numpy``, which cannot give ``bfloat16`` tensors (most
checkpoints' dtype): those are read as ``float32`` (exactly) and written back
rounded to the nearest ``bfloat16``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CheckpointFolder", "write_safetensors"]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

#: safetensors dtype -> the numpy dtype its bytes are read as (``BF16`` as
#: ``uint16``, then widened to ``float32``).
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
}


class CheckpointFolder:
    """A checkpoint folder's config and tensors (names, shapes, dtypes; values on demand).

    Attributes:
        path: the folder.
        config: ``config.json``, as read.
        files: tensor name -> the file holding it.
        entries: tensor name -> its header entry (``dtype``, ``shape``,
            ``data_offsets``).
        reads: how many tensors :meth:`tensor` has read (a count the tests
            check to see that a conversion reads one layer at a time).

    Raises:
        FileNotFoundError: no folder, no ``config.json``, no weights file,
            or a shard the index names that is not there.
        ValueError: a ``config.json`` or an index that is not JSON, or a
            file that is not safetensors (truncated or corrupt), named.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"no such checkpoint folder: {os.fspath(path)!r}")
        self.config = _read_json(self.path / CONFIG, "the model's config")
        if not isinstance(self.config, dict):
            raise ValueError(f"{os.fspath(self.path / CONFIG)!r} does not hold a JSON object")
        self.files = self._weight_map()
        self.entries: dict[str, dict[str, Any]] = {}
        self._starts: dict[Path, int] = {}
        for file in sorted(set(self.files.values())):
            header, start = read_header(file)
            self._starts[file] = start
            for name, entry in header.items():
                if self.files.get(name) == file:
                    self.entries[name] = entry
        missing = sorted(set(self.files) - set(self.entries))
        if missing:
            raise ValueError(
                f"the index names {missing[0]!r} in {self.files[missing[0]].name!r}, "
                "which does not hold it"
            )
        self.reads = 0

    def _weight_map(self) -> dict[str, Path]:
        """Tensor name -> file, from the index or the one weights file."""
        index = self.path / INDEX
        if not index.exists():
            single = self.path / SINGLE
            if not single.exists():
                raise FileNotFoundError(
                    f"{os.fspath(self.path)!r} has neither {SINGLE!r} nor {INDEX!r}"
                )
            header, _ = read_header(single)
            return dict.fromkeys(header, single)
        weight_map = _read_json(index, "the index of the shards")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{os.fspath(index)!r} has no 'weight_map' object")
        files = {name: self.path / str(file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.exists():
                raise FileNotFoundError(f"missing shard {file.name!r} named by {INDEX!r}")
        return files

    def tensor(self, name: str) -> np.ndarray:
        """One tensor's values, read from its bytes (``bfloat16`` as exact ``float32``).

        Raises:
            KeyError: no tensor ``name``.
            ValueError: a dtype other than float64, float32, float16, bfloat16.
        """
        entry, file = self.entries[name], self.files[name]
        dtype = _numpy_dtype(entry["dtype"], name)
        begin, end = entry["data_offsets"]
        with open(file, "rb") as stream:
            stream.seek(self._starts[file] + begin)
            data = stream.read(end - begin)
        array = np.frombuffer(data, dtype).reshape(entry["shape"])
        self.reads += 1
        if entry["dtype"] == "BF16":
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array.astype(dtype.newbyteorder("="))

    def rewrite(self, replacements: Mapping[str, np.ndarray]) -> list[tuple[Path, Path]]:
        """Writes each file holding a replaced tensor anew beside it, others' bytes kept.

        A replacement takes its tensor's dtype (rounded to the nearest
        ``bfloat16`` for those) and must have its shape. The new files are
        ``<file>.tmp``; the caller moves them over the old ones once all are
        written (``os.replace``), or removes them.

        Returns:
            ``(new file, file)`` for each file written.

        Raises:
            KeyError: a replacement of no tensor of the folder.
            ValueError: a replacement of another shape, named.
        """
        for name, array in replacements.items():
            shape = list(self.entries[name]["shape"])
            if list(np.shape(array)) != shape:
                raise ValueError(
                    f"{name!r} has shape {tuple(shape)} in the checkpoint; "
                    f"the weights give {tuple(np.shape(array))}"
                )
        written: list[tuple[Path, Path]] = []
        try:
            for file in sorted({self.files[name] for name in replacements}):
                written.append(self._rewritten(file, replacements))
        except BaseException:
            for new, _ in written:
                new.unlink(missing_ok=True)
            raise
        return written

    def _rewritten(self, file: Path, replacements: Mapping[str, np.ndarray]) -> tuple[Path, Path]:
        """Writes ``file`` anew as ``<file>.tmp`` with ``replacements``; returns ``(new, file)``."""
        header, start = read_header(file)
        tensors: dict[str, tuple[str, list[int], bytes]] = {}
        with open(file, "rb") as stream:
            for name, entry in header.items():
                if name in replacements:
                    data = _encode(replacements[name], entry["dtype"], name)
                else:
                    begin, end = entry["data_offsets"]
                    stream.seek(start + begin)
                    data = stream.read(end - begin)
                tensors[name] = (entry["dtype"], entry["shape"], data)
        new = file.with_name(file.name + ".tmp")
        write_safetensors(new, tensors, metadata=_metadata_of(file))
        return new, file


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, dict[str, Any]], int]:
    """A safetensors file's tensor entries, and where its data starts.

    Raises:
        ValueError: a file too short or whose header is not a safetensors one.
    """
    header = _raw_header(path)
    header.pop("__metadata__", None)
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
    return header, 8 + length


def _raw_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        prefix = stream.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < length <= size - 8:
            raise ValueError(
                f"{os.fspath(path)!r} is not a valid .safetensors file (truncated or corrupt)"
            )
        try:
            header = json.loads(stream.read(length))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{os.fspath(path)!r} is not a valid .safetensors file (bad header)")
    return header


def _metadata_of(path: Path) -> dict[str, str] | None:
    return _raw_header(path).get("__metadata__")


def _numpy_dtype(name: str, tensor: str) -> np.dtype:
    if name not in _DTYPES:
        raise ValueError(
            f"{tensor!r} is of dtype {name}; attention weights are read as F64, F32, F16 or BF16"
        )
    return _DTYPES[name]


def _encode(array: Any, dtype: str, tensor: str) -> bytes:
    """``array``'s bytes as the safetensors ``dtype`` (``BF16`` rounded to nearest even)."""
    if dtype != "BF16":
        return np.ascontiguousarray(array, _numpy_dtype(dtype, tensor)).tobytes()
    bits = np.ascontiguousarray(array, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, tuple[str, Iterable[int], bytes]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes a safetensors file of ``name -> (dtype, shape, bytes)``, in that order.

    The header is padded with spaces to a multiple of 8 bytes, as the
    safetensors library writes it.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(encoded)))
        stream.write(encoded)
        for _, _, data in tensors.values():
            stream.write(data)


def _read_json(path: Path, what: str) -> Any:
    if not path.exists():
        raise FileNotFoundError(f"{os.fspath(path.parent)!r} has no {path.name} ({what})")
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {error}") from error
