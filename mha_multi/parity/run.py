"""Runs backends on the shared case files and writes their results."""

from __future__ import annotations

import json
import os
import platform
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mha_multi.parity.cases import WEIGHTS_FILE, Case, load_cases
from mha_multi.parity.compare import compare
from mha_multi.parity.importance import IMPORTANCE_CASES, runner_importance
from mha_multi.parity.runners import DEVICES, DTYPES, Runner, get_runner
from mha_multi.weights import load_weights

__all__ = ["result_path", "run_backends"]


def result_path(directory: Path, backend: str, device: str, dtype: str, case: str) -> Path:
    return directory / backend / f"{device}__{dtype}__{case}.npz"


def workflow_output(runner: Runner, case: Case, weights_file: Path) -> np.ndarray:
    """The user's workflow: weights from one ``.safetensors`` file, then a call.

    Returns the float32 CPU output on the case's inputs.
    """
    layer = runner.layer_for(case, weights=load_weights(weights_file))
    inputs = case.inputs
    return runner.call(
        layer,
        inputs["queries"],
        inputs["keys"],
        inputs["values"],
        case.valid_lens,
        causal=case.config.causal,
    )


def run_backends(
    backends: Sequence[str],
    cases_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    require_gpu: bool = False,
    devices: Sequence[str] = DEVICES,
) -> bool:
    """Runs every case on every device and dtype of each backend.

    Writes ``out_dir/<backend>/<device>__<dtype>__<case>.npz`` per result and
    ``out_dir/<backend>/meta.json`` (versions, devices, errors). Prints a
    progress line per backend x device x dtype.

    Args:
        devices: the devices to run on, of ``"cpu"`` and ``"gpu"``.

    Returns:
        Whether everything ran (tolerances are judged by the report).
    """
    cases = load_cases(cases_dir)
    out = Path(out_dir)
    ok = True
    for backend in backends:
        runner = get_runner(backend)
        print(f"[parity] {backend}: loading {len(cases)} cases", flush=True)
        directory = out / backend
        directory.mkdir(parents=True, exist_ok=True)
        meta: dict[str, object] = {
            "backend": backend,
            "versions": {**runner.versions(), "numpy": np.__version__},
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "devices": {},
            # The (device, dtype) cells this run runs: the report misses none of them.
            "cells": [],
            "errors": [],
        }
        for device in devices:
            if not runner.device_available(device):
                if device != "cpu" and require_gpu:
                    meta["errors"].append(f"no {device} device, and MHA_MULTI_REQUIRE_GPU is set")
                    ok = False
                continue
            meta["devices"][device] = runner.device_description(device)
            for dtype in DTYPES:
                if not runner.dtype_supported(device, dtype):
                    continue
                meta["cells"].append([device, dtype])
                passed = 0
                for case in cases:
                    try:
                        results = runner.run(case, device=device, dtype=dtype)
                    except Exception:
                        meta["errors"].append(
                            f"{device} {dtype} {case.name}: {traceback.format_exc(limit=3)}"
                        )
                        ok = False
                        continue
                    path = result_path(out, backend, device, dtype, case.name)
                    with open(path, "wb") as file:
                        np.savez(file, **results)
                    passed += all(c.passed for c in compare(results, case.reference, dtype))
                print(
                    f"[parity] {backend:<18} {device:<4} {dtype:<9} "
                    f"{passed}/{len(cases)} cases within tolerance",
                    flush=True,
                )
        by_name = {case.name: case for case in cases}
        book = by_name["book"]
        try:
            output = workflow_output(runner, book, Path(cases_dir) / WEIGHTS_FILE)
            np.save(directory / "workflow.npy", output)
        except Exception:
            meta["errors"].append(f"workflow ({WEIGHTS_FILE}): {traceback.format_exc(limit=3)}")
            ok = False
        try:
            scores = {
                name: runner_importance(runner, by_name[name]).tolist() for name in IMPORTANCE_CASES
            }
            (directory / "importance.json").write_text(json.dumps(scores, indent=2))
        except Exception:
            meta["errors"].append(f"head_importance: {traceback.format_exc(limit=3)}")
            ok = False
        (directory / "meta.json").write_text(json.dumps(meta, indent=2))
    return ok
