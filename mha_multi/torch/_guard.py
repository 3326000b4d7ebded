"""Where the PyTorch facts cannot read values: SDPA behind a guard on the device.

Under ``torch.compile`` a call's values cannot be read, so a plan that
needs them read is *guarded* (:attr:`mha_multi.spec.KernelPlan.guarded`):
:meth:`GuardedKernel.guarded` puts one ``torch.cond`` in the graph whose
predicate is the eager read's test, taking SDPA where it holds and the
generic path elsewhere (docs: "Fast paths").
:class:`mha_multi.torch._facts.TorchFacts` takes it from here; this module
imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mha_multi import spec
from mha_multi.torch._kernel import BIAS_LIMIT
from mha_multi.torch._reads import finite_sum, largest_magnitude

#: Scores per head (``Q * K``) from which a compiled call runs SDPA under
#: :meth:`GuardedKernel.guarded`. Inductor fuses the generic path's masking and
#: softmax, which is as fast below it; above, SDPA is faster and never holds
#: the ``(B, H, Q, K)`` scores (docs: "Fast paths", measured there).
GUARDED_KERNEL_SCORES = 1 << 16


class GuardedKernel:
    """:meth:`mha_multi.call.Facts.values_guard` and :meth:`~mha_multi.call.Facts.guarded`
    of the PyTorch facts."""

    def values_guard(self, q: torch.Tensor, sizes: tuple[Any, Any, Any]) -> bool:
        """Under ``torch.compile``, where a head's scores are many enough
        (``GUARDED_KERNEL_SCORES``) for SDPA to beat the compiled generic path."""
        _, num_queries, num_keys = sizes
        return (
            torch.compiler.is_compiling()
            and isinstance(num_queries, int)
            and isinstance(num_keys, int)
            and num_queries * num_keys >= GUARDED_KERNEL_SCORES
        )

    def guarded(
        self,
        fused: Callable[..., torch.Tensor],
        generic: Callable[..., torch.Tensor],
        arrays: Sequence[torch.Tensor],
        bias: torch.Tensor | None,
        *,
        head_dim: int,
    ) -> torch.Tensor:
        """SDPA's context where the eager read
        (:meth:`mha_multi.torch._facts.TorchFacts.plan_values`) would have found the values
        exact, the generic path's elsewhere: one ``torch.cond`` in the graph.

        A compiled graph cannot read the values, and SDPA's own non-finite
        rows differ from the spec's (``tools/sdpa_nonfinite.py``), so the
        same test the eager call reads picks the branch on the device.
        """
        # The eager read's own test (a sum: Inductor compiles it far better
        # than isfinite().all()).
        exact = torch.isfinite(finite_sum(*arrays))
        # Scores within the limit where SDPA's added mask meets the spec's
        # replaced one (spec.scores_within_limit).
        q, k = arrays[0], arrays[1]
        bound = spec.magnitude_limit(head_dim)
        exact = exact & (largest_magnitude(q) * largest_magnitude(k) < bound)
        if bias is not None:
            exact = exact & (bias.detach().abs() <= BIAS_LIMIT).all()  # a NaN fails the limit too
        # The branches' operands may not alias one another (the projections
        # of one stacked product are views of it), nor their outputs them.
        operands = tuple(x if x._base is None else x.clone() for x in arrays)
        return torch.cond(exact, _cond_branch(fused), _cond_branch(generic), operands)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient comes back contiguous.

    ``torch.cond``'s backward pass is a conditional too, and both branches
    must give each operand's gradient the same strides; the generic path's
    ``q @ k^T`` and SDPA's kernel give the keys' gradient different ones.
    """

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _cond_branch(branch: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``branch`` as a branch of ``torch.cond`` takes it: its output a dense
    tensor of its own (both branches' strides agree, and neither is a view
    of an operand), its operands' gradients contiguous (:class:`_ContiguousGrad`)."""

    def own(*operands: torch.Tensor) -> torch.Tensor:
        operands = tuple(_ContiguousGrad.apply(x) for x in operands)
        return branch(*operands).clone(memory_format=torch.contiguous_format)

    return own
