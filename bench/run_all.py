"""Tessera against its peers, in one process, on one GPU, on the same inputs: `tessera bench`.

    python3 bench/run_all.py [tessera bench options]   (the same as: python3 -m tessera bench ...)

The cases, their peers, the timing and the statistics live in tessera/bench/ (cases.py, runner.py,
timing.py, stats.py), which the `tessera bench` command runs; this script keeps the old entry point
working from a checkout that is not pip-installed.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
