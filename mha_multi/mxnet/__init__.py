"""MXNet backend: ``MultiHeadAttention`` as a Gluon ``HybridBlock`` (numpy interface).

Importing it turns on MXNet's numpy interface (``npx.set_np()``), which the
layer is written for, as d2l does.
"""

# First: MXNet's exact-float32 environment is in place before MXNet loads
# (docs: "Architecture").
from mha_multi.mxnet import _facts  # noqa: F401

# isort: split
from mha_multi.mxnet.importance import head_importance
from mha_multi.mxnet.layer import MultiHeadAttention, get_weights, set_weights
from mha_multi.spec import KVCache

__all__ = ["KVCache", "MultiHeadAttention", "get_weights", "head_importance", "set_weights"]
