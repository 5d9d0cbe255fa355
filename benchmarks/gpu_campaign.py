"""The GPU campaign's command: one plan per command, under one budget from process start.

    python3 benchmarks/gpu_campaign.py --plan                       # the default plan, its deadlines
    python3 benchmarks/gpu_campaign.py --out $OUT                   # the default plan (GPU, <= 480 s)
    python3 benchmarks/gpu_campaign.py --second --out $OUT \\
        --figures-csv <the default run's results.csv>                # the second plan (GPU, <= 240 s)
    python3 benchmarks/gpu_campaign.py --dry-run --out /tmp/c        # CPU rehearsal, tiny sizes

Writes ``campaign.log``, ``results.csv``, ``summary.md`` and ``profile_trace.json.gz`` (the
default plan: the Llama-shaped tensorwise step; the second: the first missed figure's) into
``--out``. The items live in ``benchmarks/campaign/`` (one module per
item family); BENCHMARKS.md, "GPU campaign: how to run it", has the commands for the GPU
machine. Exit status 0 when the plan ran (its items' failures are in its files), 2 on bad
arguments, 3 when the watchdog stopped it at the budget.
"""

import time


def _since_process_start() -> float:
    """Seconds since this process started (Linux: /proc), so the budget includes the interpreter's start."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        import os

        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


T0 = time.monotonic() - _since_process_start()  # the budget counts from process start

import sys
from pathlib import Path

for _p in (str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from campaign.cli import main

if __name__ == "__main__":
    sys.exit(main(start=T0))
