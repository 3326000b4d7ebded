"""Flax: the heads exercise's layer, its importance measured and its heads pruned in JAX."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# The exercise of the docs page "Heads": the task, and its layer trained in numpy float64.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_scripts"))
import head_exercise as hx

from mha_multi.jax import MultiHeadAttention, head_importance, linen, set_weights

weights = hx.train()  # canonical float64 weights of the 8-head layer, about a second
task = hx.test_task()


def as_jax(batch):
    """(queries, keys, values, valid_lens) of a batch of the task; keys = values = memory."""
    memory = jnp.asarray(batch.memory, jnp.float32)
    return jnp.asarray(batch.queries, jnp.float32), memory, memory, None


def cross_entropy(labels):
    """The task's loss: a softmax over the symbols for each slot of each query."""
    labels = jnp.asarray(labels)

    def loss(logits):
        log_p = jax.nn.log_softmax(logits.reshape(*labels.shape, hx.NUM_SYMBOLS))
        return -jnp.take_along_axis(log_p, labels[..., None], axis=-1).mean()

    return loss


# [prune]
layer = MultiHeadAttention(**hx.CONFIG.kwargs(), rngs=nnx.Rngs(0))
set_weights(layer, weights).eval()
# The steps of torch_pruning.py: each head's importance, the 4 least important pruned.
scores, removed, (pruned, config) = hx.prune_least_important(
    head_importance, layer, as_jax, cross_entropy, weights, task
)
small = MultiHeadAttention(**config.kwargs(), rngs=nnx.Rngs(0))  # 4 heads
set_weights(small, pruned).eval()
logits = small(*as_jax(task))
# [/prune]
print(np.round(scores, 3), removed, config.num_heads)

# The 8-head layer with the removed heads' gates at 0.
gates = np.ones(hx.NUM_HEADS, np.float32)
gates[removed] = 0.0
masked = layer(*as_jax(task), head_mask=jnp.asarray(gates))
# The importance JAX measured, the logits of the 4-head layer and of the
# masked 8-head one, and the task's metrics, against the float64 reference.
hx.check_pruning(weights, task, scores, removed, pruned, np.asarray(logits), np.asarray(masked))

# Flax Linen: the same pruned weights as variables of the 4-head module.
module = linen.MultiHeadAttention(**config.kwargs())
variables = linen.variables_from_weights(pruned, module)
linen_logits = module.apply(variables, *as_jax(task))
np.testing.assert_allclose(np.asarray(linen_logits), hx.forward(pruned, task), rtol=0, atol=1e-5)
