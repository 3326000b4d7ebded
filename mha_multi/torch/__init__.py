"""PyTorch backend: ``MultiHeadAttention`` as a ``torch.nn.Module``."""

from typing import Any

from mha_multi.spec import KVCache
from mha_multi.torch.importance import head_importance
from mha_multi.torch.layer import MultiHeadAttention, get_weights, set_weights

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "get_weights",
    "head_importance",
    "set_weights",
    "shard_heads",
]


def __getattr__(name: str) -> Any:
    # torch.distributed's tensor parallelism takes about a second to import:
    # it is imported when shard_heads is first asked for (docs: "Sharding heads").
    if name == "shard_heads":
        from mha_multi.torch.sharding import shard_heads

        return shard_heads
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
