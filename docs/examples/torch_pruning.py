"""PyTorch: the heads exercise's layer, its importance measured and its heads pruned in PyTorch."""

import sys
from pathlib import Path

import numpy as np
import torch

# The exercise of the docs page "Heads": the task, and its layer trained in numpy float64.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_scripts"))
import head_exercise as hx

from mha_multi.heads import importance, prune_heads
from mha_multi.torch import MultiHeadAttention, head_importance, set_weights

weights = hx.train()  # canonical float64 weights of the 8-head layer, about a second
task = hx.test_task()


def as_torch(batch):
    """(queries, keys, values, valid_lens) of a batch of the task; keys = values = memory."""
    memory = torch.tensor(batch.memory, dtype=torch.float32)
    return torch.tensor(batch.queries, dtype=torch.float32), memory, memory, None


def cross_entropy(labels):
    """The task's loss: a softmax over the symbols for each slot of each query."""
    target = torch.as_tensor(labels).reshape(-1)
    return lambda logits: torch.nn.functional.cross_entropy(
        logits.reshape(-1, hx.NUM_SYMBOLS), target
    )


# [prune]
layer = set_weights(MultiHeadAttention(**hx.CONFIG.kwargs()), weights).eval()
# Michel et al.: |dL/dξ_h| of each batch, then the mean over batches. One batch
# per call, so that each loss holds its own batch's labels.
gradients = [
    head_importance(layer, [as_torch(batch)], cross_entropy(batch.labels), normalize=False)
    for batch in task.batches()
]
scores = importance(gradients)  # mean over the batches, divided by the norm over the heads
removed = np.argsort(scores)[:4].tolist()  # the 4 least important of the 8 heads

pruned, config = prune_heads(weights, removed, num_heads=hx.NUM_HEADS)
small = set_weights(MultiHeadAttention(**config.kwargs()), pruned).eval()  # 4 heads
with torch.no_grad():
    logits = small(*as_torch(task))
# [/prune]
print(np.round(scores, 3), removed, config.num_heads)

# The 8-head layer with the removed heads' gates at 0.
gates = torch.ones(hx.NUM_HEADS)
gates[removed] = 0.0
with torch.no_grad():
    masked = layer(*as_torch(task), head_mask=gates)
# The importance PyTorch measured, the logits of the 4-head layer and of the
# masked 8-head one, and the task's metrics, against the float64 reference.
hx.check_pruning(weights, task, scores, removed, pruned, logits.numpy(), masked.numpy())
