"""Where a benchmark ran: the device, its driver, the versions that shape the numbers, and the commit.

Each probe returns None when its subject is absent, so the description of a CPU-only machine (or of a
checkout without git) is still complete; only `device` and `driver` need a GPU.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]

#: distribution names whose versions a result records, by the key it records them under
PACKAGES = {"torch": "torch", "triton": "triton", "cuda-bindings": "cuda-bindings", "tessera": "tessera"}


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Python and each package of PACKAGES, without importing them (None: not installed). Tessera's own
    version comes from its pyproject when it runs from a checkout that was never pip-installed."""
    found = {"python": platform.python_version(), **{k: package_version(d) for k, d in PACKAGES.items()}}
    if found["tessera"] is None:
        found["tessera"] = _pyproject_version()
    return found


def _pyproject_version() -> str | None:
    import tomllib
    try:
        return tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]["version"]
    except (OSError, KeyError, ValueError):
        return None


def _git(*args: str) -> str | None:
    try:
        # GIT_OPTIONAL_LOCKS=0: `git status` must not refresh (write) the index of the checkout it describes
        done = subprocess.run(["git", "-C", str(REPOSITORY), *args], capture_output=True, text=True, timeout=10,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> tuple[str | None, bool]:
    """(HEAD's hash, whether tracked files differ from it) of the checkout Tessera runs from."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head, bool(status)


def gpu() -> tuple[str | None, str | None]:
    """(device 0's name, the driver version), through the CUDA driver; (None, None) without a GPU."""
    try:
        from ..runtime import driver
        name = driver.Device(0).name
    except Exception:   # no driver, no bindings, no device: a description, not an error
        return None, None
    return name, _driver_version() or _cuda_version(driver)


def _driver_version() -> str | None:
    """The kernel driver's version as nvidia-smi prints it (580.159.04)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else None


def _cuda_version(driver) -> str | None:
    """The CUDA version the driver supports ("CUDA 13.0"), where nvidia-smi is missing."""
    try:
        number = int(driver._call("cuDriverGetVersion"))
    except Exception:
        return None
    return f"CUDA {number // 1000}.{number % 1000 // 10}"


def describe(command: str, copy_gbs: float | None = None) -> dict:
    """The `environment` of a result file."""
    device, driver = gpu()
    head, dirty = commit()
    return {"device": device, "driver": driver, "versions": versions(), "commit": head, "dirty": dirty,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "copy_gbs": copy_gbs, "command": command}
