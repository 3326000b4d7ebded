"""MXNet benchmark: ours (fused and generic) vs d2l's MXNet ``MultiHeadAttention``.

MXNet has no multi-head attention layer of its own in Gluon's core; the
baseline is d2l's formulation of the layer for MXNet's numpy interface,
written here as a ``HybridBlock`` so that both sides run hybridized.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, npx
from mxnet.gluon import nn

from mha_multi.bench.common import Measurement, Shape, attention_flops, median_seconds
from mha_multi.mxnet import MultiHeadAttention

npx.set_np()

#: MXNet 1.9's numpy interface has no bfloat16; float16 runs fast on GPUs only.
DTYPES = ("float32", "float16")
#: Past this estimate of the (B*H, N, N) arrays an implementation holds, it is
#: not run (the machine's memory is shared).
ATTENTION_LIMIT_BYTES = 4 << 30
#: Full-size (B*H, N, N) float arrays alive at the peak of a forward pass:
#: scores and weights for ours; scores, masked scores and weights for d2l's
#: and for the generic path.
_SCORE_ARRAYS = {"ours": 2, "native": 3, "ours (generic)": 3}
#: The same for forward+backward, from measured peak memory (N = 1024: about
#: 1 GiB for ours and d2l's, 2 GiB for the generic path).
_TRAINING_SCORE_ARRAYS = {"ours": 4, "native": 4, "ours (generic)": 8}


def masked_softmax(F: Any, X: Any, valid_lens: Any) -> Any:
    """d2l's ``masked_softmax``: replace hidden scores by -1e6, then softmax.

    Args:
        F: ``mxnet.ndarray`` or ``mxnet.symbol``.
        X: scores ``(B*H, Q, K)``.
        valid_lens: ``None`` or ``(B*H,)`` (float32, as d2l passes them).
    """
    if valid_lens is None:
        return F.npx.softmax(X)
    # d2l's valid_lens.repeat(shape[1]), without the shape: one length per query row.
    rows = F.np.zeros_like(X[:, :, 0]) + F.np.expand_dims(valid_lens, -1)  # (B*H, Q)
    masked = F.npx.sequence_mask(
        F.npx.reshape(X, (-5, -2)),
        F.npx.reshape(rows, (-1,)),
        use_sequence_length=True,
        value=-1e6,
        axis=1,
    )
    return F.npx.reshape_like(F.npx.softmax(masked), X)


class DotProductAttention(gluon.HybridBlock):
    """d2l's ``DotProductAttention`` (d2l.ai, "Attention Scoring Functions", MXNet)."""

    def __init__(self, dropout: float, head_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head_dim = head_dim  # d2l reads queries.shape[-1]; symbols have no shape
        self.dropout = nn.Dropout(dropout)

    def hybrid_forward(self, F: Any, queries: Any, keys: Any, values: Any, valid_lens: Any) -> Any:
        scores = F.npx.batch_dot(queries, keys, transpose_b=True) / math.sqrt(self.head_dim)
        attention_weights = masked_softmax(F, scores, valid_lens)
        return F.npx.batch_dot(self.dropout(attention_weights), values)


class D2LMultiHeadAttention(gluon.HybridBlock):
    """d2l's ``MultiHeadAttention`` (d2l.ai, "Multi-Head Attention", MXNet numpy interface)."""

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, use_bias: bool = False
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        with self.name_scope():
            self.attention = DotProductAttention(dropout, num_hiddens // num_heads)
            self.W_q = nn.Dense(num_hiddens, use_bias=use_bias, flatten=False)
            self.W_k = nn.Dense(num_hiddens, use_bias=use_bias, flatten=False)
            self.W_v = nn.Dense(num_hiddens, use_bias=use_bias, flatten=False)
            self.W_o = nn.Dense(num_hiddens, use_bias=use_bias, flatten=False)

    def hybrid_forward(
        self, F: Any, queries: Any, keys: Any, values: Any, valid_lens: Any = None
    ) -> Any:
        queries = self.transpose_qkv(F, self.W_q(queries))
        keys = self.transpose_qkv(F, self.W_k(keys))
        values = self.transpose_qkv(F, self.W_v(values))
        if valid_lens is not None:
            valid_lens = F.np.repeat(valid_lens, self.num_heads, axis=0)
        output = self.attention(queries, keys, values, valid_lens)
        return self.W_o(self.transpose_output(F, output))

    def transpose_qkv(self, F: Any, X: Any) -> Any:
        X = F.npx.reshape(X, (-2, -2, self.num_heads, -1))
        X = F.np.transpose(X, (0, 2, 1, 3))
        return F.npx.reshape(X, (-5, -2, -2))

    def transpose_output(self, F: Any, X: Any) -> Any:
        X = F.npx.reshape(X, (-6, -1, self.num_heads, -2, -2))
        X = F.np.transpose(X, (0, 2, 1, 3))
        return F.npx.reshape(X, (-2, -2, -5))


def _ctx(device: str) -> mx.Context:
    return mx.gpu(0) if device == "gpu" else mx.cpu()


def _sync() -> None:
    mx.npx.waitall()


def _inputs(shape: Shape, ctx: mx.Context, dtype: str) -> tuple[mx.np.ndarray, mx.np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((shape.batch, shape.length, shape.num_hiddens), dtype=np.float32)
    # Key padding: example b keeps N - b*N/(2B) tokens (float32, as d2l passes them).
    lens = [shape.length - b * shape.length // (2 * shape.batch) for b in range(shape.batch)]
    return (
        mx.np.array(x, dtype=dtype, ctx=ctx),
        mx.np.array(lens, dtype="float32", ctx=ctx),
    )


def _implementations(
    shape: Shape, ctx: mx.Context, dtype: str
) -> dict[str, tuple[gluon.Block, Callable[[Any, Any], Any]]]:
    """name -> (block, call(x, lens)); both blocks hybridized.

    Not with ``static_alloc``: each cached graph would then keep its own
    full-size buffers, several GiB per graph at N = 2048.
    """
    d, h = shape.num_hiddens, shape.num_heads
    ours = MultiHeadAttention(d, h, query_size=d, key_size=d, value_size=d, dtype=dtype)
    ours.initialize(mx.init.Xavier(), ctx=ctx)
    ours.hybridize()
    native = D2LMultiHeadAttention(d, h)
    native.initialize(mx.init.Xavier(), ctx=ctx)
    native.cast(dtype)
    native.hybridize()
    return {
        "ours": (ours, lambda x, lens: ours(x, x, x, lens)),
        "ours (generic)": (
            ours,
            lambda x, lens: ours(x, x, x, lens, return_attention_weights=True)[0],
        ),
        "native": (native, lambda x, lens: native(x, x, x, lens)),
    }


def _attention_bytes(
    implementation: str, shape: Shape, dtype: str, *, training: bool = False
) -> int:
    count = shape.batch * shape.num_heads * shape.length**2
    arrays = (_TRAINING_SCORE_ARRAYS if training else _SCORE_ARRAYS)[implementation]
    return arrays * count * np.dtype(dtype).itemsize


def gemm_rate(ctx: mx.Context, dtype: str, size: int = 2048) -> float:
    """Measured GFLOP/s of a ``size`` x ``size`` matrix product."""
    a = mx.np.random.normal(size=(size, size), ctx=ctx).astype(dtype)
    b = mx.np.random.normal(size=(size, size), ctx=ctx).astype(dtype)

    def step() -> None:
        mx.np.dot(a, b).wait_to_read()

    return 2 * size**3 / median_seconds(step) / 1e9


def time_layers(lengths: Sequence[int], device: str, dtype: str, base: Shape) -> list[Measurement]:
    ctx = _ctx(device)
    measurements = []
    for length in lengths:
        shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
        x, lens = _inputs(shape, ctx, dtype)
        flops = attention_flops(shape)
        for name, (block, call) in _implementations(shape, ctx, dtype).items():
            kwargs = {
                "backend": "mxnet",
                "implementation": name,
                "device": device,
                "dtype": dtype,
                "length": length,
                "shape": vars(shape),
            }

            def forward(call: Callable = call, args: tuple = (x, lens)) -> None:
                call(*args).wait_to_read()

            def forward_backward(
                call: Callable = call, block: gluon.Block = block, args: tuple = (x, lens)
            ) -> None:
                inputs = args[0].copy()
                inputs.attach_grad()
                with autograd.record():
                    output = call(inputs, args[1])
                output.backward()  # head gradient of ones: the gradient of output.sum()
                block.collect_params().zero_grad()
                _sync()

            for mode, step, factor in (
                ("forward", forward, 1),
                ("forward+backward", forward_backward, 3),
            ):
                needed = _attention_bytes(name, shape, dtype, training=factor > 1)
                if needed > ATTENTION_LIMIT_BYTES:
                    note = f"too large (~{needed / 2**30:.0f} GiB)"
                    measurements.append(Measurement(mode=mode, note=note, **kwargs))
                    continue
                seconds = median_seconds(step)
                measurements.append(
                    Measurement(
                        mode=mode, seconds=seconds, gflops=factor * flops / seconds / 1e9, **kwargs
                    )
                )
            gc.collect()
    return measurements


def peak_memory_mib(implementation: str, length: int, device: str, base: Shape) -> float:
    """Peak resident memory of one forward pass above what inputs and weights hold."""
    shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
    ctx = _ctx(device)
    x, lens = _inputs(shape, ctx, "float32")
    _, call = _implementations(shape, ctx, "float32")[implementation]
    small = x[:, :16]
    call(small, mx.np.full_like(lens, 16)).wait_to_read()  # load kernels, thread pools
    gc.collect()
    before = _peak_rss_kib()
    call(x, lens).wait_to_read()
    return (_peak_rss_kib() - before) / 1024


def _peak_rss_kib() -> int:
    """This process's peak resident memory in KiB.

    ``VmHWM`` rather than ``ru_maxrss``: Linux keeps ``ru_maxrss`` across
    ``exec``, so a process started by a large one would start at its parent's peak.
    """
    try:
        with open("/proc/self/status") as file:
            for line in file:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure_memory(lengths: Sequence[int], device: str, base: Shape) -> list[Measurement]:
    """Each figure in a fresh process, since a process's peak RSS never falls."""
    measurements = []
    for length in lengths:
        shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
        for implementation in ("ours", "native", "ours (generic)"):
            kwargs = {
                "backend": "mxnet",
                "implementation": implementation,
                "mode": "peak memory",
                "device": device,
                "dtype": "float32",
                "length": length,
                "shape": vars(shape),
            }
            estimate = _attention_bytes(implementation, shape, "float32")
            if estimate > ATTENTION_LIMIT_BYTES:
                measurements.append(
                    Measurement(note=f"skipped (~{estimate / 2**30:.0f} GiB)", **kwargs)
                )
                continue
            command = [
                sys.executable,
                "-m",
                "mha_multi.bench.mxnet",
                "memory",
                implementation,
                str(length),
                device,
            ]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            measurements.append(Measurement(peak_mib=float(output.split()[-1]), **kwargs))
    return measurements


def run(
    *,
    lengths: Sequence[int] = (128, 512, 2048),
    memory_lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    base: Shape | None = None,
) -> list[dict[str, object]]:
    """The whole MXNet benchmark, one result per device here."""
    base = base or Shape()
    devices = ["cpu"] + (["gpu"] if mx.context.num_gpus() > 0 else [])
    results = []
    for device in devices:
        # On CPU only float32 is meaningful (MXNet's CPU float16 products are
        # emulated); on a GPU, float16 is what runs fast.
        dtypes = ["float32"] if device == "cpu" else list(DTYPES)
        measurements = []
        for dtype in dtypes:
            rate = gemm_rate(_ctx(device), dtype)
            measurements.append(
                Measurement(
                    "mxnet",
                    "gemm",
                    "gemm",
                    device,
                    dtype,
                    2048,
                    gflops=rate,
                    note=f"2048x2048 {dtype}",
                )
            )
            measurements += time_layers(lengths, device, dtype, base)
        if device == "cpu":
            # Resident memory; MXNet's GPU pool keeps no peak statistics.
            measurements += measure_memory(memory_lengths, device, base)
        results.append(
            {
                "backend": "mxnet",
                "device": "cpu" if device == "cpu" else f"gpu ({mx.context.num_gpus()})",
                "versions": {"mxnet": mx.__version__},
                "measurements": [m.as_dict() for m in measurements],
            }
        )
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    memory = commands.add_parser("memory")
    memory.add_argument("implementation")
    memory.add_argument("length", type=int)
    memory.add_argument("device")
    args = parser.parse_args(argv)
    print(json.dumps(peak_memory_mib(args.implementation, args.length, args.device, Shape())))


if __name__ == "__main__":
    main()
