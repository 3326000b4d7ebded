"""Where a result file comes from: the date, the machine and the command that made it.

The parity report and the benchmark's result files carry these fields, and the
results page prints them beside every table (docs: "Measured results").
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
from collections.abc import Sequence
from pathlib import Path

__all__ = ["command_line", "machine_info", "provenance"]


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
    return info


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
