"""d2l's exercise in numpy: measure each head's importance, prune, and check the ranking."""

import sys
from pathlib import Path

import numpy as np

# The exercise of the docs page "Heads": the task, and its layer trained in numpy float64.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_scripts"))
import head_exercise as hx

# [experiment]
weights = hx.train(seed=0)  # 8 heads; AdamW on spec.reference_gradients, about a second
task = hx.test_task()  # 512 held-out examples
full = hx.evaluate(weights, task)  # Metrics(loss, accuracy)

# Two measurements of each head: Michel et al.'s gradient of the gates (one
# backward per batch gives every head), and the direct one, each head masked
# alone (one forward per head).
scores = hx.importance(weights, task)  # mean over batches of |dL/dξ_h|, normalized
ablation = hx.ablation(weights, task)  # Metrics with head h's gate at 0

# The experiment that validates a ranking: prune least important first, and
# compare with random orders and with the opposite order. Each pruned layer is
# a smaller layer (mha_multi.heads.prune_heads), checked equal to the masked one.
order = np.argsort(scores, kind="stable").tolist()
curve = hx.prune_in_order(weights, order, task)  # Metrics after pruning order[:k], k = 0..7
reverse = hx.prune_in_order(weights, order[::-1], task)
shuffles = np.random.default_rng(1)
random = [hx.prune_in_order(weights, shuffles.permutation(8).tolist(), task) for _ in range(10)]
# The ranking measured once holds for the layer with every head; measured
# again on each pruned layer, it follows the heads that remain.
again = hx.prune_in_order(weights, hx.iterative_order(weights, task), task)
# [/experiment]
print(
    np.round(scores, 3), order
)  # [0.003 0.003 0.004 0.255 0.564 0.361 0.606 0.346] [1, 0, 2, 3, 7, 5, 4, 6]


def accuracies(curve):
    return np.array([m.accuracy for m in curve])


random_mean = np.mean([accuracies(c) for c in random], axis=0)

# The layer solves the task.
assert full.accuracy == 1.0 and full.loss < 0.01
# Three heads do nothing: their importance is near 0, and masking any one of
# them alone changes neither the accuracy nor (to 1e-3) the loss.
useless = [h for h in range(8) if scores[h] < 0.01]
assert useless == [0, 1, 2]
for h in useless:
    assert ablation[h].accuracy == 1.0 and ablation[h].loss - full.loss < 1e-3
# Each of the other heads retrieves one slot: alone, it gets that slot right
# (mostly) and the other at chance.
for h in range(8):
    if h not in useless:
        alone = hx.slot_accuracies(hx.prune(weights, [g for g in range(8) if g != h]).weights, task)
        assert alone.max() > 0.85 and alone.min() < 0.2, (h, alone)
# The gradient ranks the heads as the ablation does, from the third head on
# (the three useless heads tie in the ablation).
ablation_order = np.argsort([m.loss for m in ablation], kind="stable").tolist()
for k in range(3, 8):
    assert set(order[:k]) == set(ablation_order[:k]), k
# Half the heads go, least important first, at no cost in accuracy; random
# orders lose some on average by then, and the opposite order most of all.
assert (accuracies(curve)[:5] == 1.0).all()
assert (accuracies(curve)[:5] >= random_mean[:5]).all() and random_mean[4] < 0.99
assert (accuracies(reverse)[2:] < random_mean[2:]).all()
# With two heads left the ranking measured once falls below random orders:
# it does not see that the two heads it keeps serve the same slot. Measured
# again after each pruning, it stays above them.
assert accuracies(curve)[6] < random_mean[6] < accuracies(again)[6]
left = hx.prune(weights, order[:6]).weights  # the two heads the ranking measured once keeps
slots = hx.slot_accuracies(left, task)  # one slot right, the other at chance (1/8)
assert slots.max() > 0.99 and slots.min() < 0.25
assert (accuracies(again) >= accuracies(curve) - 1e-3).all()

# The pruned layer is smaller: its weights (W_q, W_k, W_v columns and W_o
# rows of the heads kept) shrink in proportion to the heads, and so does the
# work of every projection and of the attention itself.
sizes = [sum(w.size for w in hx.prune(weights, order[:k]).weights.values()) for k in range(8)]
assert sizes == [sizes[0] * (8 - k) // 8 for k in range(8)]
