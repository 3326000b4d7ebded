"""PyTorch benchmark: ours (fused and generic) vs ``torch.nn.MultiheadAttention``."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from collections.abc import Callable, Sequence

import torch

from mha_multi.bench.common import (
    Measurement,
    Shape,
    attention_flops,
    median_seconds,
    peak_rss_mib,
    reset_peak_rss,
)
from mha_multi.torch import MultiHeadAttention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: The generic path materialises (B*H, N, N) scores and weights; past this
#: estimate it is not run.
GENERIC_LIMIT_BYTES = 4 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _inputs(shape: Shape, device: torch.device, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape.batch, shape.length, shape.num_hiddens, generator=generator)
    x = x.to(device, dtype)
    # Key padding: example b keeps N - b*N/(2B) tokens.
    lens = torch.tensor(
        [shape.length - b * shape.length // (2 * shape.batch) for b in range(shape.batch)],
        device=device,
    )
    padding = torch.arange(shape.length, device=device)[None, :] >= lens[:, None]
    return x, lens, padding


def _implementations(shape: Shape, device: torch.device, dtype: torch.dtype):
    """name -> (module, call(x, lens, padding))."""
    d, h = shape.num_hiddens, shape.num_heads
    ours = MultiHeadAttention(
        d, h, query_size=d, key_size=d, value_size=d, device=device, dtype=dtype
    ).eval()
    native = torch.nn.MultiheadAttention(
        d, h, bias=False, batch_first=True, device=device, dtype=dtype
    ).eval()
    return {
        "ours": (ours, lambda x, lens, padding: ours(x, x, x, lens)),
        "ours (generic)": (
            ours,
            lambda x, lens, padding: ours(x, x, x, lens, return_attention_weights=True)[0],
        ),
        "native": (
            native,
            lambda x, lens, padding: native(x, x, x, key_padding_mask=padding, need_weights=False)[
                0
            ],
        ),
    }


def _generic_bytes(shape: Shape, dtype: torch.dtype) -> int:
    # Scores, masked scores and weights, each (B*H, N, N).
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 3 * shape.batch * shape.num_heads * shape.length**2 * itemsize


def gemm_rate(device: torch.device, dtype: torch.dtype, size: int = 2048) -> float:
    """Measured GFLOP/s of a ``size`` x ``size`` matrix product."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def step() -> None:
        torch.matmul(a, b)
        _sync(device)

    return 2 * size**3 / median_seconds(step) / 1e9


def time_layers(
    lengths: Sequence[int], device: torch.device, dtype_name: str, base: Shape
) -> list[Measurement]:
    dtype = DTYPES[dtype_name]
    measurements = []
    for length in lengths:
        shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
        x, lens, padding = _inputs(shape, device, dtype)
        flops = attention_flops(shape)
        for name, (module, call) in _implementations(shape, device, dtype).items():
            kwargs = {
                "backend": "torch",
                "implementation": name,
                "device": device.type,
                "dtype": dtype_name,
                "length": length,
                "shape": vars(shape),
            }
            if name == "ours (generic)" and _generic_bytes(shape, dtype) > GENERIC_LIMIT_BYTES:
                for mode in ("forward", "forward+backward"):
                    measurements.append(Measurement(mode=mode, note="too large", **kwargs))
                continue

            def forward(call: Callable = call, args: tuple = (x, lens, padding)) -> None:
                with torch.inference_mode():
                    call(*args)
                _sync(device)

            def forward_backward(
                call: Callable = call,
                module: torch.nn.Module = module,
                args: tuple = (x, lens, padding),
            ) -> None:
                inputs = args[0].detach().requires_grad_(True)
                call(inputs, *args[1:]).float().sum().backward()
                module.zero_grad(set_to_none=True)
                _sync(device)

            for mode, step, factor in (
                ("forward", forward, 1),
                ("forward+backward", forward_backward, 3),
            ):
                seconds = median_seconds(step)
                measurements.append(
                    Measurement(
                        mode=mode, seconds=seconds, gflops=factor * flops / seconds / 1e9, **kwargs
                    )
                )
            gc.collect()
    return measurements


def peak_memory_mib(implementation: str, length: int, device: str, base: Shape) -> float:
    """Peak memory of one forward pass above what its inputs and weights hold."""
    shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
    torch_device = torch.device(device)
    x, lens, padding = _inputs(shape, torch_device, torch.float32)
    _, call = _implementations(shape, torch_device, torch.float32)[implementation]
    with torch.inference_mode():
        small = x[:, :16]
        call(small, torch.full_like(lens, 16), padding[:, :16])  # load kernels, thread pools
        gc.collect()
        if torch_device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            call(x, lens, padding)
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - before) / 2**20
        reset_peak_rss()
        before = peak_rss_mib()
        call(x, lens, padding)
        return peak_rss_mib() - before


def measure_memory(lengths: Sequence[int], device: str, base: Shape) -> list[Measurement]:
    """Each figure in a fresh process, since a process's peak RSS never falls."""
    measurements = []
    for length in lengths:
        shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
        for implementation in ("ours", "native", "ours (generic)"):
            kwargs = {
                "backend": "torch",
                "implementation": implementation,
                "mode": "peak memory",
                "device": device,
                "dtype": "float32",
                "length": length,
                "shape": vars(shape),
            }
            if (
                implementation == "ours (generic)"
                and _generic_bytes(shape, torch.float32) > GENERIC_LIMIT_BYTES
            ):
                gib = _generic_bytes(shape, torch.float32) / 2**30
                measurements.append(Measurement(note=f"skipped (~{gib:.0f} GiB)", **kwargs))
                continue
            command = [
                sys.executable,
                "-m",
                "mha_multi.bench.torch",
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
    """The whole torch benchmark, one result per device here."""
    base = base or Shape()
    torch.set_float32_matmul_precision("highest")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    results = []
    for device in devices:
        # On CPU only float32 is meaningful; on a GPU, bfloat16 is what runs fast.
        dtypes = ["float32"] if device.type == "cpu" else ["float32", "bfloat16"]
        measurements = []
        for dtype_name in dtypes:
            rate = gemm_rate(device, DTYPES[dtype_name])
            measurements.append(
                Measurement(
                    "torch",
                    "gemm",
                    "gemm",
                    device.type,
                    dtype_name,
                    2048,
                    gflops=rate,
                    note=f"2048x2048 {dtype_name}",
                )
            )
            measurements += time_layers(lengths, device, dtype_name, base)
        measurements += measure_memory(memory_lengths, device.type, base)
        results.append(
            {
                "backend": "torch",
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "versions": {"torch": torch.__version__},
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
