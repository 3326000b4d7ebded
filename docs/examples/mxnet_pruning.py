"""MXNet: the heads exercise's layer, its importance measured and its heads pruned in Gluon."""

import sys
from pathlib import Path

import numpy as np
from mxnet import np as mnp

# The exercise of the docs page "Heads": the task, and its layer trained in numpy float64.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_scripts"))
import head_exercise as hx

from mha_multi.mxnet import MultiHeadAttention, head_importance, set_weights

weights = hx.train()  # canonical float64 weights of the 8-head layer, about a second
task = hx.test_task()


def as_mxnet(batch):
    """(queries, keys, values, valid_lens) of a batch of the task; keys = values = memory."""
    memory = mnp.array(batch.memory, dtype=np.float32)
    return mnp.array(batch.queries, dtype=np.float32), memory, memory, None


def cross_entropy(labels):
    """The task's loss: a softmax over the symbols for each slot of each query."""
    one_hot = mnp.array(np.eye(hx.NUM_SYMBOLS)[labels.reshape(-1)], dtype=np.float32)

    def loss(logits):
        # The log-softmax written out: the backward of npx.log_softmax (MXNet 1.9)
        # is off by about 1e-3 relative here, this one by about 1e-7.
        z = logits.reshape(-1, hx.NUM_SYMBOLS)
        z = z - z.max(axis=-1, keepdims=True)
        log_p = z - mnp.log(mnp.exp(z).sum(axis=-1, keepdims=True))
        return -(log_p * one_hot).sum() / len(one_hot)

    return loss


# [prune]
layer = set_weights(MultiHeadAttention(**hx.CONFIG.kwargs()), weights)
layer.hybridize()
# The steps of torch_pruning.py: each head's importance, the 4 least important pruned.
scores, removed, (pruned, config) = hx.prune_least_important(
    head_importance, layer, as_mxnet, cross_entropy, weights, task
)
small = set_weights(MultiHeadAttention(**config.kwargs()), pruned)  # 4 heads
logits = small(*as_mxnet(task)).asnumpy()  # outside autograd.record(): inference
# [/prune]
print(np.round(scores, 3), removed, config.num_heads)

# The 8-head layer with the removed heads' gates at 0.
gates = np.ones(hx.NUM_HEADS, np.float32)
gates[removed] = 0.0
masked = layer(*as_mxnet(task), head_mask=mnp.array(gates)).asnumpy()
# The importance MXNet measured, the logits of the 4-head layer and of the
# masked 8-head one, and the task's metrics, against the float64 reference.
hx.check_pruning(weights, task, scores, removed, pruned, logits, masked)
