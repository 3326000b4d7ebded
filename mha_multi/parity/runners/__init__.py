"""Backend runners: one small class per framework, found lazily by name.

A runner turns numpy inputs into a backend's arrays, drives its layer and
returns float64 numpy results. The parity command and the test-suite use the
same runners, so a new backend plugs in by adding one module here and one
line to :data:`RUNNERS`.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from mha_multi.parity.cases import Case

__all__ = ["DEVICES", "DTYPES", "RUNNERS", "Runner", "get_runner", "runner_names"]

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

    Subclasses implement the conversions and the framework-specific calls;
    :meth:`run` is the same for all of them.
    """

    #: Name in :data:`RUNNERS` and in reports.
    name: ClassVar[str]
    #: Distributions whose versions the report records.
    distributions: ClassVar[tuple[str, ...]]
    #: The backend package with module-level ``set_weights``/``get_weights``.
    package: ClassVar[str]

    # -- what the backend can do ------------------------------------------

    @abc.abstractmethod
    def device_available(self, device: str) -> bool:
        """Whether ``device`` (``"cpu"`` or ``"gpu"``) can run here."""

    def dtype_supported(self, device: str, dtype: str) -> bool:
        """Whether the backend runs ``dtype`` on ``device``."""
        return dtype in DTYPES

    def device_description(self, device: str) -> str:
        """Human-readable device name for reports."""
        return device

    # -- framework glue ----------------------------------------------------

    @abc.abstractmethod
    def make_layer(
        self,
        num_hiddens: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        bias: bool = False,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> Any:
        """Builds the backend's ``MultiHeadAttention`` (configuration errors propagate)."""

    @abc.abstractmethod
    def to_native(self, x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> Any:
        """``x`` as the framework's array of ``dtype`` on ``device``."""

    def set_weights(self, layer: Any, weights: Mapping[str, np.ndarray]) -> Any:
        """The backend's ``set_weights``; returns the (possibly new) layer."""
        return importlib.import_module(self.package).set_weights(layer, weights)

    def get_weights(self, layer: Any) -> dict[str, np.ndarray]:
        """The backend's ``get_weights``."""
        return importlib.import_module(self.package).get_weights(layer)

    @abc.abstractmethod
    def call(
        self,
        layer: Any,
        queries: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        valid_lens: np.ndarray | None = None,
        *,
        causal: bool = False,
        return_attention_weights: bool = False,
        training: bool = False,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Calls the layer on numpy inputs converted to ``dtype`` on ``device``.

        Numeric ``valid_lens`` keep their dtype; anything else is passed as
        it is, so that the layer's own checks answer. Returns float64 numpy.
        """

    @abc.abstractmethod
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
    ) -> dict[str, np.ndarray]:
        """Gradients of ``sum(output * output_gradient)`` (eval mode).

        Keyed ``queries``, ``keys``, ``values`` and the canonical weight
        names, in the canonical orientation, as float64 numpy.
        """

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

    def layer_for(self, case: Case, *, device: str, dtype: str) -> Any:
        """A layer of the case's configuration holding the case's weights."""
        config = case.config
        layer = self.make_layer(
            config.num_hiddens,
            config.num_heads,
            bias=config.bias,
            device=device,
            dtype=dtype,
            **config.sizes(),
        )
        return self.set_weights(layer, case.weights)

    def run(self, case: Case, *, device: str, dtype: str) -> dict[str, np.ndarray]:
        """Every checked quantity of ``case`` on ``device`` in ``dtype``.

        ``output`` comes from the default call (the fast path, where there is
        one) and ``output[weights]`` from the call that also returns the
        attention weights, so both code paths meet the reference.
        """
        layer = self.layer_for(case, device=device, dtype=dtype)
        args = (layer, case.inputs["queries"], case.inputs["keys"], case.inputs["values"])
        kwargs = {"causal": case.config.causal, "device": device, "dtype": dtype}
        results = {"output": self.call(*args, case.valid_lens, **kwargs)}
        output, weights = self.call(*args, case.valid_lens, return_attention_weights=True, **kwargs)
        results["output[weights]"] = output
        results["attention_weights"] = weights
        grads = self.gradients(
            *args, case.valid_lens, output_gradient=case.output_gradient, **kwargs
        )
        results.update({f"grad.{name}": value for name, value in grads.items()})
        return results


def as_float64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def is_numeric(x: np.ndarray | None) -> bool:
    return x is not None and isinstance(x, np.ndarray) and x.dtype.kind in "iuf"
