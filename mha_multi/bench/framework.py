"""What one framework's benchmark supplies (:class:`Framework`), and loading one by name.

Each ``mha_multi.bench.<framework>`` module defines a ``FRAMEWORK``; the
driver (:func:`mha_multi.bench.driver.run`) does the rest.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mha_multi.bench import BENCHMARKS
from mha_multi.bench.common import Shape, peak_rss_mib, reset_peak_rss
from mha_multi.bench.generate import GenerationShape, Generator
from mha_multi.weights import init_weights

__all__ = ["Framework", "Route", "load"]

#: A context the host rows are timed in (:meth:`Framework.host_routes`).
Route = Callable[[], contextlib.AbstractContextManager[Any]]


class Framework:
    """What one framework's benchmark supplies; the rest is :func:`~mha_multi.bench.driver.run`.

    ``Impl`` and ``Args`` below are whatever the framework chooses: the driver
    only hands them back. Devices and dtypes are names (``"cpu"``,
    ``"float32"``); the framework maps them to its own objects.

    Attributes:
        name: the benchmark's name, as ``python -m mha_multi.bench run`` takes it.
        implementations: names of what :meth:`build` returns: ``"ours"``,
            ``"native"`` (the framework's own layer) and variants of ours.
        executions: execution modes, each reported as a table of its own;
            ``None`` alone for a framework with one.
        fast_dtype: the 16-bit dtype timed on accelerators besides float32.
        gemm_op: what the GEMM rate is measured with, when worth saying.
    """

    name: str
    #: The backend package, whose ``set_weights`` loads canonical weights.
    package: str = ""
    #: The framework's harness (``mha_multi.parity.harness.<framework>``, which reads
    #: its facts module's names through itself):
    #: settings, devices, conversions and sync come from it by default.
    backend: Any = None
    implementations: tuple[str, ...] = ("ours", "ours (generic)", "native")
    executions: tuple[str | None, ...] = (None,)
    fast_dtype: str = "bfloat16"
    gemm_op: str = ""

    def setup(self) -> None:
        """Process-wide settings, before anything is built: exact float32 products."""
        self.backend.exact_float32()

    def devices(self) -> list[str]:
        """The devices to benchmark on, ``"cpu"`` first."""
        return ["cpu", "gpu"] if self.backend.gpu_available() else ["cpu"]

    def describe(self, device: str, execution: str | None) -> str:
        """The device (and execution mode) as the report names it."""
        return self.backend.device_description(device)

    def versions(self) -> dict[str, str]:
        """Package name -> version, for the report."""
        raise NotImplementedError

    def dtypes(self, device: str) -> list[str]:
        """The dtypes timed on ``device``.

        On a CPU only float32 is meaningful; on an accelerator, the 16-bit
        type is what runs fast.
        """
        return ["float32"] if device == "cpu" else ["float32", self.fast_dtype]

    def array(self, value: np.ndarray, device: str, dtype: str) -> Any:
        """``value`` as the framework's array on ``device`` in ``dtype``."""
        return self.backend.to_native(value, device, dtype)

    def matmul(self, a: Any, b: Any) -> Any:
        """The framework's matrix product (compiled where that is the norm)."""
        raise NotImplementedError

    def convert(
        self, x: np.ndarray, lens: np.ndarray, visible: np.ndarray, device: str, dtype: str
    ) -> Any:
        """The arguments :meth:`step` passes to the layers, from the benchmark's
        input (:func:`~mha_multi.bench.common.inputs`)."""
        raise NotImplementedError

    def build(self, shape: Shape, device: str, dtype: str) -> dict[str, Any]:
        """Implementation name -> our layer or the native one, set up to call on
        :meth:`convert`'s arguments, in evaluation mode."""
        raise NotImplementedError

    def long_pair(self, shape: Shape, device: str, dtype: str) -> dict[str, Any] | None:
        """``"ours"`` and ``"SDPA"``, the framework's own attention kernel in a layer of
        the same weights, each as :meth:`step` takes it and calling causal
        self-attention on one input (:mod:`~mha_multi.bench.long`); ``None`` where
        the framework has no such kernel of its own to hold ours to."""
        return None

    def step(self, impl: Any, args: Any, mode: str, execution: str | None) -> Callable[[], Any]:
        """One pass of ``mode`` as a function of nothing.

        ``mode`` is a key of :data:`~mha_multi.bench.timing.MODES`;
        forward+backward computes the gradients of the summed output with
        respect to the input and the weights. What the step returns is given
        to :meth:`sync`.
        """
        raise NotImplementedError

    def sync(self, value: Any) -> None:
        """Blocks until ``value`` (a step's result) is computed."""
        self.backend.sync(value)

    def scratch_bytes(
        self, implementation: str, shape: Shape, dtype: str, device: str, *, training: bool
    ) -> int:
        """Estimate of the attention arrays one pass holds at once (0: none of
        ``(B*H, N, N)`` size); past :data:`~mha_multi.bench.common.LIMIT_BYTES`
        the pass is not run."""
        raise NotImplementedError

    def measures_memory(self, device: str) -> bool:
        """Whether peak memory can be measured on ``device``."""
        return True

    def memory_step(self, impl: Any, args: Any, warmup: Any) -> Callable[[], Any]:
        """A forward step on ``args`` with what it loads on first use (kernels,
        thread pools, compiled programs) loaded, without running at full size.

        The default runs one forward pass on the small ``warmup`` arguments.
        """
        execution = self.executions[0]
        self.sync(self.step(impl, warmup, "forward", execution)())
        return self.step(impl, args, "forward", execution)

    def peak_mib(self, device: str, run: Callable[[], None]) -> float:
        """Peak memory that ``run`` adds, in MiB; the default reads resident memory."""
        reset_peak_rss()
        before = peak_rss_mib()
        run()
        return peak_rss_mib() - before

    def label(self, execution: str | None) -> str:
        """The result's backend name for ``execution``."""
        return self.name if execution is None else f"{self.name} ({execution})"

    # -- generation (mha_multi.bench.generate) ------------------------------

    #: The framework's twenty-line static-cache decoder,
    #: ``hand_written(weights, shape, device, dtype) -> Generator`` (a
    #: ``staticmethod``), timed as the ``hand-written`` generation row; in
    #: an execution mode other than the first it is also given
    #: ``execution=`` (the mode its decoder is to be written for).
    hand_written: Callable[..., Generator] | None = None
    #: The execution modes generation is timed in, each in its own table:
    #: the first of :attr:`executions` unless a framework compiles its decoding.
    generation_executions: tuple[str | None, ...] | None = None

    def append(self, sequence: Any, token: Any) -> Any:
        """``sequence`` ``(B, N, D)`` with ``token`` ``(B, 1, D)`` appended on axis 1."""
        raise NotImplementedError

    def ours(self, shape: Shape, device: str, dtype: str, **options: Any) -> Any:
        """Our layer of ``shape``'s self-attention, holding seeded canonical weights;
        ``options`` are the layer's (``rotary=``)."""
        d = shape.num_hiddens
        weights = init_weights(d, num_heads=shape.num_heads, num_kv_heads=shape.kv_heads)
        return self.layer(weights, device, dtype, num_heads=shape.num_heads, **options)

    def layer(
        self,
        weights: Mapping[str, np.ndarray],
        device: str,
        dtype: str,
        *,
        num_heads: int,
        head_dim: int | None = None,
        **options: Any,
    ) -> Any:
        """Our layer holding ``weights``, its configuration read from them;
        ``options`` are the layer's other arguments (``rotary=``)."""
        num_kv_heads = weights["W_k"].shape[1] * num_heads // weights["W_q"].shape[1]
        layer = self.backend.make_layer(
            weights["W_o"].shape[1],
            num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            query_size=weights["W_q"].shape[0],
            key_size=weights["W_k"].shape[0],
            value_size=weights["W_v"].shape[0],
            bias="b_q" in weights,
            device=device,
            dtype=dtype,
            **options,
        )
        return importlib.import_module(self.package).set_weights(layer, weights)

    #: Shard counts of the sharded-heads rows (docs: "Sharding heads"), 1
    #: being the unsharded layer; empty where the framework shards nothing.
    shard_counts: tuple[int, ...] = ()
    #: The execution mode :meth:`sharded_seconds` measures (its table).
    sharded_execution: str | None = None

    def sharded_seconds(self, shape: Shape, num_shards: int) -> float:
        """Median seconds of one float32 CPU forward of ``shape``'s self-attention,
        the heads sharded over ``num_shards`` CPU devices or processes, each
        measured in fresh processes."""
        raise NotImplementedError

    def forward_call(self, layer: Any) -> Callable[[Any, Any], Any]:
        """``call(x, valid_lens) -> output``: self-attention in evaluation mode,
        compiled where that is the framework's norm."""
        return lambda x, lens: self.backend.forward(layer, x, x, x, lens)

    def cached_call(self, layer: Any, execution: str | None = None) -> Callable[..., Any]:
        """``call(x, cache) -> (output, cache)``: one causal self-attention call
        with a cache, in ``execution`` (compiled where that is its norm)."""
        return lambda x, cache: self.backend.forward(layer, x, x, x, None, causal=True, cache=cache)

    # -- host rows (mha_multi.bench.host) ------------------------------------

    #: The framework's hand-written one-token call, ``hand_written_call(weights,
    #: shape, device, dtype) -> call(x)`` (a ``staticmethod``): causal
    #: self-attention without a cache, rotary where ``shape`` is; the anchor of
    #: the host rows, which are timed where there is one.
    hand_written_call: Callable[..., Callable[[Any], Any]] | None = None

    def eager_layer_call(self, layer: Any, *, training: bool = False) -> Callable[..., Any]:
        """``call(x, cache=None)``: our layer called eagerly (nothing compiled) on
        ``x`` as queries, keys and values: the output, or with a cache, causal,
        ``(output, cache)``. ``training``: in training mode, recording gradients.

        Raises:
            NotImplementedError: ``training`` where the framework does not count it.
        """
        if training:
            raise NotImplementedError(f"{self.name} counts no training calls")

        def call(x: Any, cache: Any = None) -> Any:
            if cache is None:
                return layer(x, x, x)
            return layer(x, x, x, causal=True, cache=cache)

        return call

    def host_routes(self, device: str) -> dict[str, Route]:
        """Route -> the context the host rows are timed in: ``"cpu"``, the route a call
        on ``device`` takes, and ``"gpu"`` where the framework can take a GPU's route
        on the CPU."""
        return {"cpu": contextlib.nullcontext}

    def causal_call(self, layer: Any) -> Callable[[Any], Any]:
        """``call(x) -> output``: the causal forward over all of ``x``, no cache."""
        return lambda x: self.backend.forward(layer, x, x, x, None, causal=True)

    def cached_generator(
        self, layer: Any, cached: Callable[..., Any], shape: GenerationShape
    ) -> Generator:
        """Generation by ``cached(x, cache) -> (output, cache)`` of ``layer``, from a new
        cache of ``shape``'s ``max_length`` positions."""

        def prefill(prompt: Any) -> tuple[Any, Any]:
            cache = self.backend.init_cache(layer, shape.batch, shape.max_length)
            output, cache = cached(prompt, cache)
            return cache, output[:, -1:]

        def step(cache: Any, token: Any) -> tuple[Any, Any]:
            output, cache = cached(token, cache)
            return cache, output

        return Generator(prefill, step, self.sync, self.backend.to_numpy)

    def generators(
        self, shape: GenerationShape, device: str, dtype: str, execution: str | None = None
    ) -> dict[str, Callable[[], Generator]]:
        """Name -> a function making a fresh :class:`Generator` (a new cache each time).

        The default drives ours through :meth:`cached_call` and
        :meth:`causal_call`, and adds :attr:`hand_written` where there is one;
        a framework with a cached decoder of its own adds it as ``"native"``.
        In a compiled ``execution`` other than the first, the recomputing
        decoder is left out: its input grows at every step, so every step
        would compile anew.
        """
        layer = self.ours(shape.attention_shape(), device, dtype, **shape.layer_options)
        cached, causal = self.cached_call(layer, execution), self.causal_call(layer)

        def with_cache() -> Generator:
            return self.cached_generator(layer, cached, shape)

        def recompute() -> Generator:
            def prefill(prompt: Any) -> tuple[Any, Any]:
                return prompt, causal(prompt)[:, -1:]

            def step(sequence: Any, token: Any) -> tuple[Any, Any]:
                sequence = self.append(sequence, token)
                return sequence, causal(sequence)[:, -1:]

            return Generator(prefill, step, self.sync, self.backend.to_numpy)

        generators = {"cached": with_cache}
        if execution == self.executions[0]:
            generators["recompute"] = recompute
        if self.hand_written is not None:
            weights = importlib.import_module(self.package).get_weights(layer)
            hand_written = self.hand_written
            if execution != self.executions[0]:
                hand_written = functools.partial(hand_written, execution=execution)
            generators["hand-written"] = lambda: hand_written(weights, shape, device, dtype)
        return generators


def load(name: str) -> Framework:
    """The framework benchmarked as ``name`` (a key of ``BENCHMARKS``).

    Raises:
        SystemExit: the module benchmarks another name, as a Keras module
            does in a process whose ``KERAS_BACKEND`` is another backend.
    """
    framework: Framework = importlib.import_module(BENCHMARKS[name]).FRAMEWORK
    if framework.name != name:
        raise SystemExit(f"[bench] {name} asked for, but this process benchmarks {framework.name}")
    return framework
