"""Keras 3 backend: ``MultiHeadAttention`` as a ``keras.layers.Layer``.

The layer is written against ``keras.ops`` and runs on whichever Keras
backend is active (``KERAS_BACKEND``: TensorFlow, JAX or PyTorch).
"""

from mha_multi.keras.importance import head_importance
from mha_multi.keras.layer import MultiHeadAttention, get_weights, set_weights
from mha_multi.keras.sharding import layout_map
from mha_multi.spec import KVCache

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "get_weights",
    "head_importance",
    "layout_map",
    "set_weights",
]
