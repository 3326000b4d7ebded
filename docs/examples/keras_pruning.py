"""Keras 3: the heads exercise's layer, its importance measured and its heads pruned in Keras."""

import sys
from pathlib import Path

import keras
import numpy as np

# The exercise of the docs page "Heads": the task, and its layer trained in numpy float64.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_scripts"))
import head_exercise as hx

from mha_multi.keras import MultiHeadAttention, head_importance, set_weights

weights = hx.train()  # canonical float64 weights of the 8-head layer, about a second
task = hx.test_task()


def as_keras(batch):
    """(queries, keys, values, valid_lens) of a batch of the task; keys = values = memory."""
    memory = keras.ops.convert_to_tensor(batch.memory, "float32")
    return keras.ops.convert_to_tensor(batch.queries, "float32"), memory, memory, None


def cross_entropy(labels):
    """The task's loss: a softmax over the symbols for each slot of each query."""
    target = keras.ops.convert_to_tensor(labels.reshape(-1))

    def loss(logits):
        logits = keras.ops.reshape(logits, (-1, hx.NUM_SYMBOLS))
        return keras.ops.mean(
            keras.losses.sparse_categorical_crossentropy(target, logits, from_logits=True)
        )

    return loss


# [prune]
layer = set_weights(MultiHeadAttention(**hx.CONFIG.kwargs()), weights)
# The steps of torch_pruning.py: each head's importance, the 4 least important pruned.
scores, removed, (pruned, config) = hx.prune_least_important(
    head_importance, layer, as_keras, cross_entropy, weights, task
)
small = set_weights(MultiHeadAttention(**config.kwargs()), pruned)  # 4 heads
logits = keras.ops.convert_to_numpy(small(*as_keras(task)))
# [/prune]
print(np.round(scores, 3), removed, config.num_heads)

# The 8-head layer with the removed heads' gates at 0.
gates = np.ones(hx.NUM_HEADS, np.float32)
gates[removed] = 0.0
masked = layer(*as_keras(task), head_mask=keras.ops.convert_to_tensor(gates))
# The importance Keras measured, the logits of the 4-head layer and of the
# masked 8-head one, and the task's metrics, against the float64 reference.
hx.check_pruning(weights, task, scores, removed, pruned, logits, keras.ops.convert_to_numpy(masked))
