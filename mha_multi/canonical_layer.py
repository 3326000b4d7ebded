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

from mha_multi import spec
from mha_multi.weights import SINKS_NAME, check_weights

__all__ = ["FromCanonical"]

Layer = TypeVar("Layer", bound="FromCanonical")


class FromCanonical:
    """The classmethod :meth:`from_canonical`; a backend's class defines ``_load_canonical``."""

    @classmethod
    def from_canonical(
        cls: type[Layer], weights: Mapping[str, Any], *, num_heads: int, **kwargs: Any
    ) -> Layer:
        """The layer of ``kwargs`` holding canonical ``weights``.

        What the weights' shapes and entries say is taken from them:
        ``num_hiddens`` (``W_o``'s columns), the input sizes, ``bias``,
        ``sinks``, and the head layout of ``num_heads`` query heads
        (``num_kv_heads``, ``head_dim``). ``kwargs`` are the constructor's
        other arguments (``rotary``, ``window``, ``qk_norm``...), as the
        converters return them, and may give any of those too.

        Raises:
            ValueError: weights that are not canonical, or that do not fit
                ``num_heads`` or the arguments.
        """
        _, config = check_weights(weights, qk_norm=None, sinks=None)
        heads = spec.heads_of_weights(weights, num_heads, num_kv_heads=kwargs.get("num_kv_heads"))
        found = {
            "bias": config.bias,
            "query_size": config.query_size,
            "key_size": config.key_size,
            "value_size": config.value_size,
            "num_kv_heads": heads.num_kv_heads,
            "head_dim": heads.head_dim,
            "sinks": SINKS_NAME in weights,
        }
        # (num_hiddens among the arguments, as LayerConfig.kwargs() gives it: the same
        # value, or a layer the weights do not fit, which loading them names.)
        num_hiddens = kwargs.pop("num_hiddens", config.num_hiddens)
        layer = cls(num_hiddens, num_heads, **{**found, **kwargs})
        return layer._load_canonical(weights)

    def _load_canonical(self: Layer, weights: Mapping[str, Any]) -> Layer:
        raise NotImplementedError
