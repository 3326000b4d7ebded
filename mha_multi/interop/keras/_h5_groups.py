"""The groups of a Keras ``.weights.h5`` file: where an attention layer's arrays lie, which layer.

Part of :mod:`mha_multi.interop.keras`: what ``model.save_weights`` writes
for a model holding one ``keras.layers.MultiHeadAttention`` or
``keras.layers.GroupQueryAttention``, read with ``h5py`` alone.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha_multi.interop.keras._mha import KERAS_MHA_NAMES

__all__ = ["weights_file_format"]


#: The groups of a ``.weights.h5`` file under a ``MultiHeadAttention``'s own
#: group -> its sublayer names (:data:`KERAS_MHA_NAMES`).
_MHA_FILE_GROUPS = {f"{name}_dense": name for name in KERAS_MHA_NAMES}
#: Likewise for ``GroupQueryAttention``, whose projections Keras saves under
#: the attributes that hold them (``_query_dense``...), not under their names.
_GQA_FILE_GROUPS = {
    "_query_dense": "query",
    "_key_dense": "key",
    "_value_dense": "value",
    "_output_dense": "attention_output",
}
#: A gated ``GroupQueryAttention``'s gate projection, refused when read.
_GQA_GATE_GROUP = {"_gate_dense": "gate"}


def _open_weights_file(path: str) -> Any:
    """``h5py.File(path, "r")``, with the errors of the file readers.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a file that is not HDF5, or is damaged.
    """
    import h5py

    if not os.path.exists(path):  # h5py reports it as a plain OSError
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    try:
        return h5py.File(path, "r")
    except OSError as error:  # h5py's error for a file that is not HDF5, or is damaged
        raise ValueError(f"{path!r} is not a readable .weights.h5 file: {error}") from error


def _find_groups(file: Any, children: Mapping[str, str]) -> list[Any]:
    """The groups of an h5 weights file that hold all of ``children`` (a layer's projections)."""
    import h5py

    found = []

    def visit(_: str, group: Any) -> None:
        if isinstance(group, h5py.Group) and all(child in group for child in children):
            found.append(group)

    file.visititems(visit)
    return found


def _only_group(path: str, file: Any, children: Mapping[str, str], layer: str) -> Any:
    """The one group holding a ``keras.layers.<layer>``'s projections.

    Raises:
        ValueError: none or several, named.
    """
    groups = _find_groups(file, children)
    if len(groups) != 1:
        names = [group.name for group in groups]
        raise ValueError(
            f"{path!r} must hold exactly one keras.layers.{layer}; "
            f"found {len(groups)} {names if names else ''}".rstrip()
        )
    return groups[0]


def _group_arrays(group: Any, children: Mapping[str, str]) -> dict[str, np.ndarray]:
    """``<sublayer>/kernel`` and ``<sublayer>/bias`` of the projections under ``group``.

    Children missing from ``group`` are skipped.

    Raises:
        ValueError: a projection holding other variables than a kernel and
            an optional bias.
    """
    arrays = {}
    for child, name in children.items():
        if child not in group:
            continue
        variables = group[child].get("vars", {})
        keys = sorted(variables, key=int)
        if keys not in (["0"], ["0", "1"]):
            raise ValueError(
                f"{group.name}/{child} holds variables {keys}; expected a kernel "
                "and an optional bias"
            )
        arrays[f"{name}/kernel"] = np.asarray(variables["0"])
        if len(keys) == 2:
            arrays[f"{name}/bias"] = np.asarray(variables["1"])
    return arrays


def weights_file_format(path: str | os.PathLike[str]) -> str:
    """Which layer a Keras ``.weights.h5`` file holds: ``"keras-gqa"`` or ``"keras-mha"``.

    A file with a ``GroupQueryAttention``'s projections (groups
    ``_query_dense``... under the layer's group) and no
    ``MultiHeadAttention``'s is ``keras-gqa``; any other is taken for
    ``keras-mha``, whose reader then checks it.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a file that is not HDF5, or is damaged.
    """
    with _open_weights_file(os.fspath(path)) as file:
        grouped = _find_groups(file, _GQA_FILE_GROUPS)
        multi_head = _find_groups(file, _MHA_FILE_GROUPS)
    return "keras-gqa" if grouped and not multi_head else "keras-mha"
