"""The lengths eager cached calls on Keras returned, with their values known on the host."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from mha_multi.keras._frameworks import active
from mha_multi.keras._ops import OPS

__all__ = ["WRITTEN_LENGTHS", "WrittenLengths"]


class WrittenLengths:
    """The lengths eager cached calls returned, with their values known on the host.

    A decoding step reads its cache's lengths to check and plan the call
    (docs: "Generating with a cache"); a read from a GPU waits for it. The
    lengths the step before wrote are known without one. An entry holds
    while its tensor lives, unchanged: TensorFlow's and JAX's arrays cannot
    be written, PyTorch's tell by their version counters and addresses. (PyTorch's
    own layer keeps this in its ``CacheCheck``, in such a table too: attributes of a
    tensor are pickled with it, and TensorFlow's and JAX's arrays take none.)
    """

    def __init__(self) -> None:
        # id -> (the tensor, weakly; its version; its values).
        self._held: dict[int, tuple[Any, Any, np.ndarray]] = {}

    def remember(self, lengths: Any, values: np.ndarray) -> None:
        """That ``lengths``, a tensor an eager call made, holds ``values``."""
        version = active().version(lengths)
        if version is None:
            return
        key = id(lengths)
        # The entry goes with its tensor, before the id can name another.
        forget = weakref.ref(lengths, lambda _: self._held.pop(key, None))
        values = np.array(values, dtype=OPS.dtype(lengths))
        values.flags.writeable = False
        self._held[key] = (forget, version, values)

    def known(self, x: Any) -> np.ndarray | None:
        """The values of ``x`` where :meth:`remember` holds them still, else ``None``."""
        entry = self._held.get(id(x)) if x is not None else None
        if entry is None or entry[0]() is not x or active().version(x) != entry[1]:
            return None
        return entry[2]


#: Lengths of the caches eager calls returned (:meth:`KerasFacts.read` looks here first).
WRITTEN_LENGTHS = WrittenLengths()
