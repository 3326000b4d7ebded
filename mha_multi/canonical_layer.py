"""``MultiHeadAttention.from_canonical(weights, **kwargs)``: a layer built and loaded in one call.

Every backend's layer class takes this mixin, so a converted layer
(:func:`mha_multi.interop.transformers.attention_layers`'s ``(index,
weights, kwargs)``, or :func:`mha_multi.interop.llama.from_llama`'s
``(weights, kwargs)``) becomes the framework's layer the same way in each
(docs: "Porting weights").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

__all__ = ["FromCanonical"]

Layer = TypeVar("Layer", bound="FromCanonical")


class FromCanonical:
    """The classmethod :meth:`from_canonical`; a backend's class defines ``_load_canonical``."""

    @classmethod
    def from_canonical(cls: type[Layer], weights: Mapping[str, Any], **kwargs: Any) -> Layer:
        """The layer of ``kwargs`` holding canonical ``weights``.

        ``num_hiddens`` is the output projection's width (``W_o``'s columns);
        ``kwargs`` are the constructor's other arguments (``num_heads``,
        ``num_kv_heads``, ``rotary``...), as the converters return them.

        Raises:
            ValueError: weights that do not fit the arguments (the backend's
                ``set_weights``' message).
        """
        num_hiddens = int(np.shape(weights["W_o"])[1])
        return cls(num_hiddens, **kwargs)._load_canonical(weights)

    def _load_canonical(self: Layer, weights: Mapping[str, Any]) -> Layer:
        raise NotImplementedError
