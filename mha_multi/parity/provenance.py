"""Where a result file comes from: the date, the machine and the command that made it.

The parity report and the benchmark's result files carry these fields, and the
results page prints them beside every table (docs: "Measured results").
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

__all__ = ["command_line", "describe_machine", "machine_info", "provenance"]


def machine_info() -> dict[str, object]:
    """Platform, processor, core count and Python version of this machine."""
    info: dict[str, object] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    # NVIDIA's driver names its GPUs here, with no framework to ask.
    models = []
    for path in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        for line in path.read_text().splitlines():
            if line.startswith("Model:"):
                models.append(line.split(":", 1)[1].strip())
    if models:
        info["gpus"] = models
        try:
            version = Path("/proc/driver/nvidia/version").read_text()
        except OSError:
            version = ""
        found = re.search(r"Kernel Module\s+(\S+)", version)
        if found:
            info["gpu_driver"] = found.group(1)
    return info


def describe_machine(machine: dict[str, object]) -> str:
    """A machine as one line: its processor and cores, GPUs and driver, system and Python."""
    parts = []
    processor, cores = machine.get("cpu") or machine.get("processor"), machine.get("cpu_count")
    if processor:
        parts.append(f"{processor} ({cores} cores)" if cores else str(processor))
    elif cores:
        parts.append(f"{cores} CPU cores")
    gpus = list(machine.get("gpus") or [])
    for model in sorted(set(gpus)):
        count = gpus.count(model)
        parts.append(f"{count} x {model}" if count > 1 else str(model))
    if machine.get("gpu_driver"):
        parts.append(f"driver {machine['gpu_driver']}")
    if machine.get("platform"):
        parts.append(str(machine["platform"]).split("-")[0])
    if machine.get("python"):
        parts.append(f"Python {machine['python']}")
    return ", ".join(parts) or "an unrecorded machine"


def command_line(program: str, arguments: Sequence[str]) -> str:
    """``program`` and its ``arguments`` as one shell line, paths relative to here.

    A path below the working directory is written relative to it, so that
    the line reads the same on every checkout of the repository.
    """
    here = Path.cwd()
    words = []
    for argument in arguments:
        path = Path(argument)
        if path.is_absolute() and path.is_relative_to(here):
            argument = str(path.relative_to(here)) or "."
        words.append(argument)
    return " ".join([program, *(shlex.quote(word) for word in words)])


def provenance(program: str, arguments: Sequence[str]) -> dict[str, object]:
    """``{"date", "machine", "command"}`` of a run started now by ``program arguments``.

    The date is UTC, to the second, in ISO 8601.
    """
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return {
        "date": now.isoformat().replace("+00:00", "Z"),
        "machine": machine_info(),
        "command": command_line(program, arguments),
    }
