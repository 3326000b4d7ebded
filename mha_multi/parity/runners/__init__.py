"""Backend runners: one small class per framework, found lazily by name.

A runner turns numpy inputs into a backend's arrays, drives its layer
through the framework's harness (:mod:`mha_multi.parity.harness`) and
returns float64 numpy results. The parity command and the test-suite use the
same runners, so a new backend plugs in by adding its harness, one module
here and one line to :data:`RUNNERS`.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from mha_multi import spec
from mha_multi.parity.cases import Case
from mha_multi.parity.decode import Chunk, decode
from mha_multi.parity.harness import KernelCall

__all__ = [
    "DEVICES",
    "DTYPES",
    "RUNNERS",
    "Runner",
    "get_runner",
    "runner_names",
]

#: Runner name -> "module:Class". Importing the module imports the framework.
RUNNERS: dict[str, str] = {
    "torch": "mha_multi.parity.runners.torch:TorchRunner",
    "jax-nnx": "mha_multi.parity.runners.jax:JaxNNXRunner",
    "jax-linen": "mha_multi.parity.runners.jax:JaxLinenRunner",
    "mxnet": "mha_multi.parity.runners.mxnet:MXNetRunner",
    "mxnet-hybrid": "mha_multi.parity.runners.mxnet:MXNetHybridRunner",
    "keras-tensorflow": "mha_multi.parity.runners.keras:KerasTensorFlowRunner",
    "keras-jax": "mha_multi.parity.runners.keras:KerasJaxRunner",
    "keras-torch": "mha_multi.parity.runners.keras:KerasTorchRunner",
}

DEVICES = ("cpu", "gpu")
DTYPES = ("float64", "float32", "bfloat16", "float16")


def runner_names() -> list[str]:
    return list(RUNNERS)


def get_runner(name: str) -> Runner:
    """Imports and instantiates the runner ``name`` (and so its framework)."""
    try:
        module_name, class_name = RUNNERS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(RUNNERS)}") from None
    return getattr(importlib.import_module(module_name), class_name)()


class Runner(abc.ABC):
    """Drives one backend's layer from numpy.

    A runner names the framework's harness (:attr:`harness`: layer
    construction, one forward call and one vector-Jacobian product, and
    through it the facts module's conversions and devices) and hands it
    every framework call; a runner overrides only what differs (JAX's Linen
    runner, MXNet's hybridized one). :meth:`call`, :meth:`gradients` and
    :meth:`run` are written here once.
    """

    #: Name in :data:`RUNNERS` and in reports.
    name: ClassVar[str]
    #: Distributions whose versions the report records.
    distributions: ClassVar[tuple[str, ...]]
    #: The backend package with module-level ``set_weights``/``get_weights``.
    package: ClassVar[str]
    #: What drives the framework's layer, by import path
    #: (:mod:`mha_multi.parity.harness`): imported when a runner is made, so
    #: that listing the runners imports no framework.
    harness: ClassVar[str]
    #: The fused kernel a default call may plan for (docs: "Fast paths");
    #: ``None`` where the default call always takes the generic path.
    fused_kernel: ClassVar[spec.FusedKernel | None] = None
    #: Whether the backend reads the shortest length before it plans (so
    #: lengths that hide nothing need no mask).
    reads_shortest_length: ClassVar[bool] = False
    #: Whether the fused kernel's call takes the positions and biases options
    #: (:attr:`mha_multi.call.Facts.passes_options`).
    passes_options: ClassVar[bool] = False
    #: Whether an eager call's rotary tables at the default positions are made
    #: once per signature and reused by later calls (docs: "Fast paths").
    keeps_rotary_tables: ClassVar[bool] = False

    def __init__(self) -> None:
        self.facts = importlib.import_module(self.harness)
        self.facts.exact_float32()

    # -- what the backend can do ------------------------------------------

    def device_available(self, device: str) -> bool:
        """Whether ``device`` (``"cpu"`` or ``"gpu"``) can run here."""
        return device == "cpu" or (device == "gpu" and self.facts.gpu_available())

    def dtype_supported(self, device: str, dtype: str) -> bool:
        """Whether the backend runs ``dtype`` on ``device``."""
        return dtype in self.facts.DTYPES

    def device_description(self, device: str) -> str:
        """Human-readable device name for reports."""
        return self.facts.device_description(device)

    # -- framework glue: the harness's -------------------------------------

    def make_layer(self, num_hiddens: int, num_heads: int, **kwargs: Any) -> Any:
        """Builds the backend's ``MultiHeadAttention`` (configuration errors propagate).

        ``kwargs`` are the layer's keyword arguments (``dropout``, ``bias``,
        ``query_size``, ``key_size``, ``value_size``, the head options
        ``num_kv_heads`` and ``head_dim``...), passed to it as given, and
        ``device`` and ``dtype`` (``"cpu"`` and ``"float32"`` by default).
        """
        return self.facts.make_layer(num_hiddens, num_heads, **kwargs)

    def to_native(self, x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> Any:
        """``x`` as the framework's array of ``dtype`` on ``device``."""
        return self.facts.to_native(x, device, dtype)

    def to_numpy(self, x: Any) -> np.ndarray:
        """A framework array (bfloat16 included) as float64 numpy, on the host."""
        return self.facts.to_numpy(x)

    def native_lens(self, valid_lens: Any, device: str = "cpu") -> Any:
        """``valid_lens`` as the framework's array on ``device``, keeping its dtype.

        Anything that is not a numeric numpy array is passed as it is, so
        that the layer's own checks answer.
        """
        return self.facts.lens_to_native(valid_lens, device)

    def set_weights(self, layer: Any, weights: Mapping[str, np.ndarray]) -> Any:
        """The backend's ``set_weights``; returns the (possibly new) layer."""
        return importlib.import_module(self.package).set_weights(layer, weights)

    def get_weights(self, layer: Any) -> dict[str, np.ndarray]:
        """The backend's ``get_weights``."""
        return importlib.import_module(self.package).get_weights(layer)

    def forward(
        self,
        layer: Any,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any,
        *,
        training: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Calls the layer on framework arrays; ``kwargs`` are the layer's
        (``causal``, ``return_attention_weights``). Returns framework arrays."""
        return self.facts.forward(
            layer, queries, keys, values, valid_lens, training=training, **kwargs
        )

    def vjp(
        self,
        layer: Any,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any,
        *,
        causal: bool,
        output_gradient: Any,
        cache: spec.KVCache | None = None,
        head_mask: Any = None,
        positions: Any = None,
        bias: Any = None,
        segment_ids: Any = None,
    ) -> Mapping[str, Any]:
        """The vector-Jacobian product of an eval-mode call at ``output_gradient``.

        Keyed ``queries``, ``keys``, ``values`` and the canonical weight names,
        in the canonical orientation, as framework arrays. With a ``cache``,
        of the output of that cached call, the cache held fixed; with a
        ``head_mask`` or a ``bias``, its gradient too, keyed by its name;
        ``positions`` and ``segment_ids`` are passed on.
        """
        given = {"cache": cache, "head_mask": head_mask, "positions": positions, "bias": bias}
        given["segment_ids"] = segment_ids
        return self.facts.vjp(
            layer,
            queries,
            keys,
            values,
            valid_lens,
            causal=causal,
            output_gradient=output_gradient,
            **{name: value for name, value in given.items() if value is not None},
        )

    def init_cache(self, layer: Any, batch_size: int, max_length: int) -> spec.KVCache:
        """The layer's empty cache (``layer.init_cache``), of its dtype and device."""
        return self.facts.init_cache(layer, batch_size, max_length)

    def head_importance(
        self, layer: Any, batches: Any, loss_fn: Callable[[Any], Any], *, normalize: bool = True
    ) -> np.ndarray:
        """The backend's public ``head_importance`` (docs: "Heads")."""
        package = importlib.import_module(self.package)
        return package.head_importance(layer, batches, loss_fn, normalize=normalize)

    def inner_product(self, a: Any, b: Any) -> Any:
        """``sum(a * b)`` of two framework arrays, as a differentiable scalar."""
        return (a * b).sum()

    def kernel_spy(self) -> contextlib.AbstractContextManager[list[KernelCall]]:
        """Records every call of the backend's fused kernel while active."""
        return self.facts.kernel_spy()

    # -- written once -------------------------------------------------------

    def call(
        self,
        layer: Any,
        queries: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        valid_lens: np.ndarray | None = None,
        *,
        training: bool = False,
        device: str = "cpu",
        dtype: str = "float32",
        **kwargs: Any,
    ) -> np.ndarray | tuple[np.ndarray, ...]:
        """Calls the layer on numpy inputs converted to ``dtype`` on ``device``.

        Numeric ``valid_lens`` keep their dtype; anything else is passed as
        it is, so that the layer's own checks answer. ``kwargs`` are the
        layer's (``causal``, ``return_attention_weights``). Returns float64
        numpy.
        """
        arrays = [self.to_native(x, device, dtype) for x in (queries, keys, values)]
        lens = self.native_lens(valid_lens, device)
        result = self.forward(layer, *arrays, lens, training=training, **kwargs)
        if isinstance(result, (tuple, list)):
            return tuple(self.to_numpy(r) for r in result)
        return self.to_numpy(result)

    def gradients(
        self,
        layer: Any,
        queries: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        valid_lens: np.ndarray | None,
        *,
        causal: bool,
        output_gradient: np.ndarray,
        device: str,
        dtype: str,
        head_mask: np.ndarray | None = None,
        positions: np.ndarray | None = None,
        bias: np.ndarray | None = None,
        segment_ids: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """Gradients of ``sum(output * output_gradient)`` (eval mode).

        Keyed ``queries``, ``keys``, ``values`` and the canonical weight
        names, in the canonical orientation, as float64 numpy; and
        ``head_mask`` and ``bias`` where given.
        """
        arrays = [self.to_native(x, device, dtype) for x in (queries, keys, values)]
        gates = {
            name: self.to_native(value, device, dtype)
            for name, value in (("head_mask", head_mask), ("bias", bias))
            if value is not None
        }
        for name, ids in (("positions", positions), ("segment_ids", segment_ids)):
            if ids is not None:
                gates[name] = self.native_lens(ids, device)
        grads = self.vjp(
            layer,
            *arrays,
            self.native_lens(valid_lens, device),
            causal=causal,
            output_gradient=self.to_native(output_gradient, device, dtype),
            **gates,
        )
        return {name: self.to_numpy(value) for name, value in grads.items()}

    def decode(
        self,
        layer: Any,
        inputs: Mapping[str, np.ndarray],
        lengths: np.ndarray,
        chunks: Sequence[Chunk],
        *,
        max_length: int,
        device: str = "cpu",
        dtype: str = "float32",
        **kwargs: Any,
    ) -> np.ndarray:
        """Feeds ragged sequences to the layer's cache call by call (causal).

        Args:
            layer: the backend's layer.
            inputs: the full ``queries``, ``keys`` and ``values``, ``(B, N, ·)``.
            lengths: ``(B,)`` real positions of each sequence.
            chunks: the schedule (:mod:`mha_multi.parity.decode`).
            max_length: the cache's capacity.
            device, dtype: where and in what the layer runs.
            kwargs: the layer's (``return_attention_weights``).

        Returns:
            The outputs at the real positions, ``(B, N, num_hiddens)``
            float64, 0 past ``lengths``.
        """
        cache = self.init_cache(layer, len(lengths), max_length)

        def step(queries: Any, keys: Any, values: Any, new_lens: np.ndarray) -> np.ndarray:
            nonlocal cache
            arrays = [self.to_native(x, device, dtype) for x in (queries, keys, values)]
            lens = self.native_lens(new_lens, device)
            result = self.forward(layer, *arrays, lens, causal=True, cache=cache, **kwargs)
            output, cache = result[0], result[-1]
            return self.to_numpy(output)

        return decode(step, inputs, lengths, chunks)

    def call_as_given(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        """Calls the layer the way a user of the framework does, converting nothing.

        For the layer's own argument checks (a Python list where an array
        belongs must meet the layer, not a conversion in the runner).
        """
        return layer(*args, **kwargs)

    # -- shared ---------------------------------------------------------------

    def versions(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        found = {}
        for distribution in self.distributions:
            try:
                found[distribution] = version(distribution)
            except PackageNotFoundError:
                found[distribution] = "not installed"
        return found

    def layer_for(
        self,
        case: Case,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        weights: Mapping[str, np.ndarray] | None = None,
    ) -> Any:
        """A layer of the case's configuration holding ``weights`` (the case's by default)."""
        config = case.config
        layer = self.make_layer(
            config.num_hiddens,
            config.num_heads,
            bias=config.bias,
            device=device,
            dtype=dtype,
            **config.sizes(),
            **config.heads(),
            **config.layer_options(),
        )
        return self.set_weights(layer, case.weights if weights is None else weights)

    def case_options(
        self, case: Case, *, device: str = "cpu", dtype: str = "float32"
    ) -> dict[str, Any]:
        """The layer's call options of ``case``: ``causal``, and its gates, positions and
        bias as native arrays."""
        options: dict[str, Any] = {"causal": case.config.causal}
        for name, value in self._case_arrays(case).items():
            if name in ("positions", "segment_ids"):
                options[name] = self.native_lens(value, device)
            else:
                options[name] = self.to_native(value, device, dtype)
        return options

    @staticmethod
    def _case_arrays(case: Case) -> dict[str, np.ndarray]:
        """The case's ``head_mask``, ``positions``, ``bias`` and ``segment_ids``, where it has
        them."""
        arrays = {
            "head_mask": None
            if case.config.head_mask is None
            else np.asarray(case.config.head_mask, np.float32),
            "positions": case.positions,
            "bias": case.bias,
            "segment_ids": case.segment_ids,
        }
        return {name: value for name, value in arrays.items() if value is not None}

    def run(self, case: Case, *, device: str, dtype: str) -> dict[str, np.ndarray]:
        """Every checked quantity of ``case`` on ``device`` in ``dtype``.

        ``output`` comes from the default call (the fast path, where there is
        one) and ``output[weights]`` from the call that also returns the
        attention weights, so both code paths meet the reference. A cached
        case gives both outputs of its schedule (:meth:`decode`).
        """
        layer = self.layer_for(case, device=device, dtype=dtype)
        if case.config.cached:
            # Both code paths of a cached call, against one causal forward.
            decoding = (layer, case.inputs, case.valid_lens, case.config.chunks)
            options = {"max_length": case.config.cache_length, "device": device, "dtype": dtype}
            return {
                "output": self.decode(*decoding, **options),
                "output[weights]": self.decode(*decoding, return_attention_weights=True, **options),
            }
        args = (layer, case.inputs["queries"], case.inputs["keys"], case.inputs["values"])
        kwargs = {"device": device, "dtype": dtype}
        options = self.case_options(case, device=device, dtype=dtype)
        results = {"output": self.call(*args, case.valid_lens, **kwargs, **options)}
        output, weights = self.call(
            *args, case.valid_lens, return_attention_weights=True, **kwargs, **options
        )
        results["output[weights]"] = output
        results["attention_weights"] = weights
        grads = self.gradients(
            *args,
            case.valid_lens,
            output_gradient=case.output_gradient,
            causal=case.config.causal,
            **kwargs,
            **self._case_arrays(case),
        )
        results.update({f"grad.{name}": value for name, value in grads.items()})
        return results


def as_float64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)
