"""Head importance of the head-mask cases, the same in every framework (docs: "Heads").

Each backend's public ``head_importance`` is given the case's weights, two
batches (the case's inputs, and the same examples in reverse order) and the
loss ``sum(output * G)`` with the case's output gradient ``G`` (calls
without ``causal``, as ``head_importance`` makes them); the float64
reference is :func:`mha_multi.heads.importance` of the gates' gradients from
:func:`mha_multi.spec.reference_gradients`. Written once for every runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mha_multi import spec
from mha_multi.heads import importance
from mha_multi.parity.cases import Case

if TYPE_CHECKING:
    from mha_multi.parity.runners import Runner

__all__ = ["IMPORTANCE_CASES", "importance_batches", "reference_importance", "runner_importance"]

#: The cases whose weights and inputs the importance is measured on.
IMPORTANCE_CASES = ("head_mask", "head_mask_gqa")

Batch = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]


def importance_batches(case: Case) -> list[Batch]:
    """The case's inputs, then the same examples in reverse order (a second batch
    whose loss differs, since ``G`` does not move with them)."""
    inputs = case.inputs
    first = (inputs["queries"], inputs["keys"], inputs["values"], case.valid_lens)
    second = tuple(None if x is None else np.ascontiguousarray(x[::-1]) for x in first)
    return [first, second]  # type: ignore[list-item]


def reference_importance(case: Case, *, normalize: bool = True) -> np.ndarray:
    """The float64 importance of the case's heads at a mask of ones."""
    config = case.config
    ones = np.ones(config.num_heads)
    gradients = [
        spec.reference_gradients(
            case.weights,
            *batch,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            # head_importance calls the layer as batches give it: not causal.
            output_gradient=case.output_gradient,
            head_mask=ones,
        )["head_mask"]
        for batch in importance_batches(case)
    ]
    return importance(gradients, normalize=normalize)


def runner_importance(runner: Runner, case: Case, *, normalize: bool = True) -> np.ndarray:
    """The backend's public ``head_importance`` on the case, float32 on the CPU."""
    layer = runner.layer_for(case)
    batches = [
        (*(runner.to_native(x) for x in batch[:3]), runner.native_lens(batch[3]))
        for batch in importance_batches(case)
    ]
    gradient = runner.to_native(case.output_gradient.astype(np.float32))

    def loss(output: Any) -> Any:
        return runner.inner_product(output, gradient)

    return np.asarray(runner.head_importance(layer, batches, loss, normalize=normalize))
