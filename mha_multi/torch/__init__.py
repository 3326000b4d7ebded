"""PyTorch backend: ``MultiHeadAttention`` as a ``torch.nn.Module``."""

from mha_multi.spec import KVCache
from mha_multi.torch.layer import MultiHeadAttention, get_weights, head_importance, set_weights

__all__ = ["KVCache", "MultiHeadAttention", "get_weights", "head_importance", "set_weights"]
