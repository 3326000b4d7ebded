"""The PyTorch layer's projections: lazy sizes, 16-bit products, stacked weights, and the
base class that runs them for the driver."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

from mha_multi import spec
from mha_multi.torch._ops import OPS, linear, needs_float32_copies

__all__ = [
    "PackedProjections",
    "StackedView",
    "StackedWeights",
    "addresses",
    "finish_lazy",
    "in_features",
    "infer_size",
    "pack",
    "parametrized_projection",
    "project_with",
    "projection",
    "split_stacked",
]


def parametrized_projection(modules: dict[str, nn.Module]) -> TypeError:
    """The refusal of projections whose weight a parametrization computes
    (``torch.nn.utils.parametrize``, ``weight_norm``): the layer takes its
    projections' weights and biases as parameters, packed for one product."""
    names = [
        name for name in ("W_q", "W_k", "W_v", "W_o") if "weight" not in modules[name]._parameters
    ]
    return TypeError(
        f"the layer's {', '.join(names)}: a weight computed by a parametrization "
        "(torch.nn.utils.parametrize, weight_norm) is not supported, the layer takes "
        "its projections' weights as parameters; remove it first, keeping the weight it "
        'computes (parametrize.remove_parametrizations(module, "weight"), '
        "remove_weight_norm(module))"
    )


def projection(in_features: int | None, out_features: int, bias: bool) -> nn.Module:
    if in_features is None:
        return LazyProjection(out_features, bias=bias)
    return nn.Linear(in_features, out_features, bias=bias)


class LazyProjection(nn.LazyLinear):
    """``nn.LazyLinear`` whose rows are the layer's: a lazy module takes the shape of
    what it loads, and a state dict of other heads (another ``num_kv_heads``) loaded
    into it was taken, failing at the first call. Its parameters take the layer's rows
    and the input size loaded; the load then names the mismatch of the rows, as it
    does for a layer built with its input sizes (``RuntimeError``, "size mismatch").
    Becomes an ``nn.Linear`` once its input size is known, as ``nn.LazyLinear`` does.
    """

    def _lazy_load_hook(self, state_dict: Any, prefix: str, *args: Any) -> None:
        rows = self.out_features
        weight, bias = (state_dict.get(prefix + name) for name in ("weight", "bias"))
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 2):
            weight = None  # (its input size unknown: the load takes it as it is)
        if weight is not None and (
            weight.shape[0] != rows
            or (isinstance(bias, torch.Tensor) and tuple(bias.shape) != (rows,))
        ):
            shapes = {"weight": (rows, weight.shape[1]), "bias": (rows,)}
            with torch.no_grad():
                for name, shape in shapes.items():
                    parameter = self._parameters.get(name)
                    if parameter is not None and type(parameter) is UninitializedParameter:
                        parameter.materialize(shape)
        super()._lazy_load_hook(state_dict, prefix, *args)


def in_features(linear: nn.Module) -> int | None:
    """The projection's input size, ``None`` while lazy.

    Read from the parameter table rather than through ``nn.Module``'s
    attribute lookup: every call asks, and a small call's cost is such work.
    """
    weight = linear._parameters["weight"]
    if type(weight) is UninitializedParameter:
        return None
    return int(weight.shape[1])


def finish_lazy(linear: nn.Module) -> None:
    """Turns a lazy projection whose weight was loaded into a plain ``nn.Linear``.

    Loading materialises the parameters but leaves the lazy class and its
    hooks until the first call; a call on an empty batch finishes the job
    now, so later calls (and ``torch.compile``) see an ordinary module.
    """
    if isinstance(linear, nn.modules.lazy.LazyModuleMixin):
        linear.in_features = int(linear.weight.shape[1])
        weight = linear.weight
        linear(torch.zeros(0, linear.in_features, device=weight.device, dtype=weight.dtype))


def infer_size(module: nn.Module, x: torch.Tensor) -> bool:
    """A lazy projection learns its input size from ``x`` (nothing is computed);
    whether it did now.

    Its parameters are made ordinary tensors even under
    ``torch.inference_mode``, where they would otherwise be inference
    tensors, which cannot be trained later.
    """
    if in_features(module) is None:
        with torch.inference_mode(False), torch.no_grad():
            module(x[:0])
        return True
    return False


def project_with(module: nn.Module, x: torch.Tensor, sharded: bool) -> torch.Tensor:
    """The projection ``module`` of ``x``, a 16-bit product accumulated in float32 and
    rounded once.

    The product of the module's parameters, as every other product of the
    layer is taken (and ``nn.MultiheadAttention``'s ``out_proj``): no forward
    hook of the module runs. A ``sharded`` layer's module is called instead
    where the product is not 16-bit: its tensor parallelism runs through the
    module's hooks (docs: "Sharding heads").
    """
    if sharded and not needs_float32_copies(x, module.weight):
        return module(x)
    infer_size(module, x)
    parameters = module._parameters
    return linear(x, parameters["weight"], parameters["bias"])


def addresses(modules: Sequence[nn.Module]) -> list[int | None]:
    """Where the parameters of ``modules`` lie (``None`` for a lazy or absent one)."""
    return [
        p.data_ptr() if type(p) is nn.Parameter else None
        for m in modules
        for p in m._parameters.values()
    ]


def pack(modules: Sequence[nn.Module]) -> None:
    """Lays the weights of ``modules`` back to back in one storage, and their biases in
    another, keeping every parameter object, so that their stack is a view of them
    (:class:`StackedWeights`).

    As ``nn.RNNBase.flatten_parameters`` does for a recurrent layer's weights:
    the layer packs its input projections when it makes them, when it learns
    lazy sizes, when weights are set, after every conversion (``.to()``,
    ``.double()``...) and in a copy (``copy.deepcopy``, unpickling), which give
    each parameter storage of its own. A view
    needs no copy, and follows every change of the parameters, in place
    through ``.data`` included. Projections that cannot be packed (lazy,
    of other input sizes, dtypes or devices, or not plain tensors) are left
    as they are; :class:`StackedWeights` then stacks them at every call.
    """
    for name in ("weight", "bias"):
        params = [m._parameters.get(name) for m in modules]
        first = params[0]
        if first is None or not all(
            type(p) is nn.Parameter and type(p.data) is torch.Tensor for p in params
        ):
            continue
        if _adjacent(params) is not None:
            continue  # packed already
        if not all(
            p.dtype == first.dtype and p.device == first.device and p.shape[1:] == first.shape[1:]
            for p in params
        ):
            continue
        # (Outside inference mode, as infer_size makes them: a layer whose sizes its first
        # call learns under torch.inference_mode packs there, and inference tensors as its
        # parameters could not be trained later.)
        with torch.inference_mode(False), torch.no_grad():
            buffer = torch.cat([p.detach().reshape(-1) for p in params])
        offset = 0
        for p in params:
            p.data = buffer[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()


class StackedWeights:
    """The stacked weights (and biases) of projections that share their input.

    Packed parameters (:func:`pack`) are stacked as a view of them, which
    follows every change of them; a call that records gradients takes it
    through :class:`StackedView`, whose gradient is each parameter's block.
    A compiled graph, and projections that are not packed, stack them anew
    at every call (a copy, part of a recorded graph). The view is kept for
    the next call while the parameters lie where it does: each parameter is
    still set to an alias of it as the view found it (the same storage,
    offset, sizes and strides, :meth:`torch.Tensor.is_set_to`) and of its
    dtype.
    """

    def __init__(self) -> None:
        self._key: list[Any] | None = None
        self._views: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # Each module's parameter table, and aliases of its weight and bias as the view
        # found them: while every parameter is set to its alias (the same storage,
        # offset, sizes and strides) and of its dtype, the view holds (no key made).
        # (Three of them, the last one repeated where there are two: views.)
        self._held: tuple[tuple[dict, torch.Tensor, torch.Tensor | None], ...] | None = None

    def __call__(self, modules: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)`` of ``modules`` stacked along the output features."""
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            # (A compiled graph's parameters have no address to view; under torch.func's
            # transforms the stack is an ordinary copy, which they differentiate and batch.)
            return _stack(modules)
        views = self.views(modules)
        if views is None:
            return _stack(modules)
        if not torch.is_grad_enabled():
            return views
        weight, bias = views
        weight = StackedView.of(weight, [m._parameters["weight"] for m in modules])
        if bias is None:
            return weight, None
        return weight, StackedView.of(bias, [m._parameters["bias"] for m in modules])

    def views(
        self, modules: Sequence[nn.Module]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(weight, bias)`` of ``modules`` (two or three projections) as views of their
        back-to-back parameters, for eager code that records no gradient; ``None`` where
        they are not back to back."""
        held = self._held
        if held is not None:
            # Where the view was made, one call per parameter tells that it holds, written
            # out for three projections (two, where keys and values alone share their
            # input: the last one twice): a decoding step's cost is such work, a loop's
            # own included (docs: "Fast paths").
            try:
                q, k, v = modules[0], modules[1], modules[-1]  # (_as_three, inline: every step)
                (tq, wq, bq), (tk, wk, bk), (tv, wv, bv) = held
                if q._parameters is tq and k._parameters is tk and v._parameters is tv:
                    p, r, t = tq["weight"], tk["weight"], tv["weight"]
                    if (
                        p.is_set_to(wq)
                        and r.is_set_to(wk)
                        and t.is_set_to(wv)
                        and p.dtype is wq.dtype
                        and r.dtype is wk.dtype
                        and t.dtype is wv.dtype
                        and (
                            tq["bias"] is None and tk["bias"] is None and tv["bias"] is None
                            if bq is None  # (the view's biases are all there or none is)
                            else _set_to(tq["bias"], bq)
                            and _set_to(tk["bias"], bk)
                            and _set_to(tv["bias"], bv)
                        )
                    ):
                        return self._views
            except (RuntimeError, TypeError, NotImplementedError, ValueError, IndexError):
                pass  # (a tensor of another kind set as a parameter's data: asked below)
            self._key = self._held = None  # (moved: made again, strides included)
        if not 2 <= len(modules) <= 3:
            raise ValueError(f"{len(modules)} projections stacked: two or three are")
        try:
            # The parameter tables, not nn.Module's attribute lookup: every call asks.
            # (A loop, not a comprehension: a step's cost is such calls.)
            key: list[Any] = []
            for module in modules:
                parameters = module._parameters
                for p in (parameters["weight"], parameters["bias"]):
                    key += (None if p is None else (p.data_ptr(), p.shape, p.dtype),)
        except RuntimeError:  # a tensor without storage of its own (a DTensor's)
            return None
        if key != self._key:
            tables = [m._parameters for m in modules]
            weights = [table["weight"] for table in tables]
            with torch.no_grad():  # (a view of the storage, no part of any graph)
                self._key, self._views = key, _views(weights, [table["bias"] for table in tables])
                self._held = (
                    None
                    if self._views is None
                    else _as_three(
                        [
                            (
                                table,
                                table["weight"].detach(),
                                None if table["bias"] is None else table["bias"].detach(),
                            )
                            for table in tables
                        ]
                    )
                )
        return self._views

    def clear(self) -> None:
        """Forgets the view (the parameters were packed anew: the old memory may go)."""
        self._key = self._views = self._held = None


class StackedView(torch.autograd.Function):
    """The view of packed parameters that :class:`StackedWeights` stacks, as a function of
    those parameters: no copy is made, and each parameter's gradient is its block of the
    stack's (a copy's gradient, to the bit).

    A product saves the view for its backward pass, and the view shares the first
    parameter's version counter only: the parameters are saved too, so that a change of
    any of them in place before the backward pass raises PyTorch's error, as it does
    for ``nn.Linear``'s weight.
    """

    @staticmethod
    def forward(
        ctx: Any, size: torch.Size, stride: tuple[int, ...], *parameters: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(*parameters)
        # (Made here, of the parameters as they are: a view kept from an earlier call
        # would have seen its base change in place since.)
        return parameters[0].as_strided(size, stride)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # (Raises where a parameter changed in place since the forward pass.)
        parameters = ctx.saved_tensors
        return (None, None, *gradient.split([p.shape[0] for p in parameters], 0))

    @classmethod
    def of(cls, view: torch.Tensor, parameters: list[torch.Tensor]) -> torch.Tensor:
        """``view``'s stack of ``parameters``, recorded where one of them requires a gradient."""
        # (A loop, not any() of a list: every call that records gradients asks.)
        for parameter in parameters:
            if parameter.requires_grad:
                break
        else:
            return view
        return _apply_stacked_view(view.shape, view.stride(), *parameters)


def _c_apply(function: type[torch.autograd.Function]) -> Any:
    """``function.apply`` as PyTorch's C implementation runs it, without the Python layer
    of ``autograd.Function.apply`` (about twenty function calls of functorch's checks,
    a small call's cost on the host: docs "Results"), which only functorch's transforms
    need; ``function.apply`` itself where that implementation cannot be reached.

    The parameters a stack views have storage of their own
    (:meth:`StackedWeights.views` reads their addresses), so none is a functorch
    wrapper, which that layer would unwrap.
    """
    apply = vars(torch._C._FunctionBase).get("apply")
    if apply is None:
        # (Another PyTorch, or the documentation build's stand-in for it, which has no
        # apply at all.)
        return getattr(function, "apply", None)
    return apply.__get__(None, function)


_apply_stacked_view = _c_apply(StackedView)


def _as_three(items: Sequence[Any]) -> tuple[Any, Any, Any]:
    """Two or three ``items`` as three, the last one twice where there are two
    (:meth:`StackedWeights.views`)."""
    return items[0], items[1], items[-1]


def _set_to(p: torch.Tensor | None, alias: torch.Tensor) -> bool:
    """Whether parameter ``p`` is still set to ``alias`` (the same storage, offset, sizes
    and strides) and of its dtype: :meth:`StackedWeights.views`' test of each weight, for
    a bias, which may be ``None`` (the weights' written out there: every step asks)."""
    return p is not None and p.is_set_to(alias) and p.dtype is alias.dtype


def _views(
    weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The stack of packed ``weights`` and ``biases`` as views, or ``None`` where they are not."""
    weight = _adjacent(weights)
    if weight is None:
        return None
    if all(b is None for b in biases):
        return weight, None
    bias = None if any(b is None for b in biases) else _adjacent(biases)  # type: ignore[arg-type]
    return None if bias is None else (weight, bias)


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view of ``tensors`` where they lie back to back in one storage (rows of one
    matrix), from an address aligned as a new tensor's is; else ``None``.

    (The alignment keeps a product of the view to the numbers of a product
    of a stacked copy, which a compiled graph takes.)
    """
    first = tensors[0]
    address = first.data_ptr()
    if address % 64:
        return None
    rows = 0
    for x in tensors:
        if x.data_ptr() != address or not x.is_contiguous() or x.shape[1:] != first.shape[1:]:
            return None
        address += x.numel() * x.element_size()
        rows += x.shape[0]
    if any(x.dtype != first.dtype for x in tensors):
        return None
    # Back to back within the first one's storage: then all in it.
    storage = first.untyped_storage()
    if address > storage.data_ptr() + storage.nbytes():
        return None
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def split_stacked(
    product: torch.Tensor, heads: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)``: the column blocks of self-attention's stacked projection
    ``(..., query_features + 2 * kv_features)`` of ``heads`` (a :class:`mha_multi.spec.Heads`)."""
    widths = [heads.query_features, heads.kv_features, heads.kv_features]
    q, k, v = product.split_with_sizes(widths, dim=-1)
    return q, k, v


def _stack(modules: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([m.weight for m in modules])
    biases = [m.bias for m in modules]
    return weight, None if biases[0] is None else torch.cat(biases)


class PackedProjections(nn.Module):
    """The layer's four projections as the driver calls them (:class:`mha_multi.call.Projections`).

    The layer makes ``W_q``, ``W_k``, ``W_v`` and ``W_o`` (``nn.Linear``, or
    ``nn.LazyLinear`` for sizes left to the first call), its heads and a
    :class:`StackedWeights`; this base keeps the input projections'
    parameters back to back (:func:`pack`) through every conversion and runs
    the products, one for inputs that are one tensor.
    """

    #: How the heads are split over processes (a ``HeadSharding``); ``None``
    #: until :func:`mha_multi.torch.shard_heads` (docs: "Sharding heads").
    _sharding: Any = None
    _heads: spec.Heads
    _stacks: StackedWeights
    num_heads: int

    def _pack(self) -> None:
        """The input projections' parameters back to back (:func:`pack`), unless sharded."""
        if self._sharding is None:
            pack([self.W_q, self.W_k, self.W_v])
            self._stacks.clear()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (copy.deepcopy) or an unpickled layer (torch.save of the module) gives
        # each parameter storage of its own: packed again, as after a conversion (a
        # stack made anew at every call is slower, and its product may round otherwise).
        super().__setstate__(state)
        self._pack()

    def _apply(self, fn: Any, recurse: bool = True) -> PackedProjections:
        # A conversion (.to(), .double()...) gives each parameter storage of its
        # own: packed again, as nn.RNNBase flattens its weights again. What
        # works in place (share_memory()) keeps the parameters where they are.
        before = addresses([self.W_q, self.W_k, self.W_v])
        module = super()._apply(fn, recurse)
        if addresses([self.W_q, self.W_k, self.W_v]) != before:
            self._pack()
        return module

    @property
    def heads(self) -> spec.Heads:
        """The heads this process computes (all of them unless sharded)."""
        return self._heads

    def project_inputs(
        self, queries: torch.Tensor, keys: torch.Tensor | None, values: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """The three input projections; one GEMM for inputs that are one tensor.

        Self-attention (``queries is keys is values``) and shared keys/values
        project with the weights stacked, as ``nn.MultiheadAttention`` does:
        every output element is the same dot product, and the backward pass
        gets one input gradient instead of a sum of three.
        """
        if keys is None:
            return project_with(self.W_q, queries, self._sharding is not None), None, None
        if queries is keys and keys is values and self._sharding is None:
            # Self-attention, every step of a decode: the one product.
            heads = self._heads
            q, k, v = self.project_stacked(queries).split_with_sizes(
                (heads.query_features, heads.kv_features, heads.kv_features), dim=-1
            )
            return q, k, v
        modules = self._modules
        projections = [modules["W_q"], modules["W_k"], modules["W_v"]]
        inputs = [queries, keys, values]
        if any([infer_size(module, x) for module, x in zip(projections, inputs, strict=True)]):
            self._pack()
        first = 0 if queries is keys else 1
        shared = [i for i in range(first, 3) if inputs[i] is inputs[first]]
        # Sharded projections run as their modules: their hooks distribute
        # the inputs and outputs (docs: "Sharding heads").
        separate = self._sharding is not None or len(shared) < 2
        if separate:
            sharded = self._sharding is not None
            return tuple(
                project_with(module, x, sharded)
                for module, x in zip(projections, inputs, strict=True)
            )
        weight, bias = self._stacks([projections[i] for i in shared])
        # Grouped heads project queries wider than keys and values.
        widths = [projections[i].out_features for i in shared]
        packed = linear(inputs[first], weight, bias).split_with_sizes(widths, dim=-1)
        outputs = dict(zip(shared, packed, strict=True))
        return tuple(
            outputs[i] if i in outputs else project_with(projections[i], inputs[i], False)
            for i in range(3)
        )

    def stacked_parameters(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)`` of ``W_q``, ``W_k`` and ``W_v`` stacked along the output
        features (:class:`StackedWeights`; lazy sizes learnt from ``queries``)."""
        modules = self._modules
        projections = [modules["W_q"], modules["W_k"], modules["W_v"]]
        # (Only a lazy projection's weight is uninitialized: every call asks, so no call
        # is made for the others.)
        for module in projections:
            if type(module._parameters["weight"]) is UninitializedParameter:
                if any([infer_size(projection, queries) for projection in projections]):
                    self._pack()
                break
        return self._stacks(projections)

    def stacked_records_gradient(self, queries: torch.Tensor) -> bool:
        """Whether :meth:`project_stacked` of ``queries`` records a gradient (the facts'
        ``records_gradient`` of the call's queries), asked before the product."""
        if not torch.is_grad_enabled():
            return False
        if queries.requires_grad:
            return True
        modules = self._modules
        for name in ("W_q", "W_k", "W_v"):
            for parameter in modules[name]._parameters.values():
                if parameter is not None and parameter.requires_grad:
                    return True
        return False

    def project_stacked(self, queries: torch.Tensor) -> torch.Tensor:
        """Self-attention's three projections of ``queries`` side by side, one product
        ``(..., query_features + 2 * kv_features)`` (an unsharded layer's)."""
        if torch.compiler.is_compiling():
            # A traced parameter has no address to view the packed stack at, and stacking
            # would copy every weight at every call: three products, side by side.
            modules = self._modules
            products = []
            for name in ("W_q", "W_k", "W_v"):
                parameters = modules[name]._parameters
                products.append(linear(queries, parameters["weight"], parameters["bias"]))
            return torch.cat(products, -1)
        weight, bias = self.stacked_parameters(queries)
        return linear(queries, weight, bias)

    def output_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)`` of ``W_o``."""
        parameters = self._modules["W_o"]._parameters
        return parameters["weight"], parameters["bias"]

    def sink_logits(self) -> torch.Tensor:
        """The heads' sink logits ``(H,)``: this process's share where the heads are sharded."""
        logits = self._parameters["sinks"]
        return logits if self._sharding is None else self._sharding.local_sinks(logits)

    def project_output(self, context: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
        """``W_o`` of the gated context (the gates need no device: OPS places nothing)."""
        if gates is None and self._sharding is None:
            # The product itself, as for the stacked input projections: only a
            # sharded layer's hooks need the module called.
            weight, bias = self.output_parameters()
            return linear(context, weight, bias)
        module = self._modules["W_o"]
        gated = spec.apply_head_mask(OPS, context, gates, self.num_heads)
        return project_with(module, gated, self._sharding is not None)
