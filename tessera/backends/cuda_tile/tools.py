"""Find and run NVIDIA's Tile IR tools: `tileiras` (bytecode -> cubin) and `tileirdisasm`.

Where they are looked for, in order: the `TESSERA_TILEIRAS` environment variable (the path of
`tileiras`; `tileirdisasm` is taken from the same directory), NVIDIA's pip wheels
(`nvidia-cuda-tileiras` installs them under `nvidia/cu13/bin` of the `nvidia` namespace package),
then PATH. Nothing imports this module at `import tessera`; the backend imports it when it assembles.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile

from tessera.errors import TesseraError

ENV_VAR = "TESSERA_TILEIRAS"
INSTALL_HINT = "install it with `python3 -m pip install nvidia-cuda-tileiras`, or set TESSERA_TILEIRAS to its path"


def _wheel_bin_dirs() -> list[str]:
    try:
        import nvidia
    except ImportError:
        return []
    dirs = []
    for root in getattr(nvidia, "__path__", []):
        for sub in ("cu13", "cuda_tileiras", "cu12"):
            d = os.path.join(root, sub, "bin")
            if os.path.isdir(d):
                dirs.append(d)
    return dirs


def find_tool(name: str) -> str | None:
    """The path of `tileiras`, `tileirdisasm` (or another tool shipped beside them), or None."""
    env = os.environ.get(ENV_VAR)
    if env:
        candidate = env if name == "tileiras" else os.path.join(os.path.dirname(env), name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    for d in _wheel_bin_dirs():
        candidate = os.path.join(d, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which(name)


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        raise TesseraError(f"`{name}` (NVIDIA CUDA Tile IR tools) was not found: {INSTALL_HINT}")
    return path


def _run(argv: list[str], what: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TesseraError(f"{what} took longer than {timeout:.0f}s: {' '.join(argv)}") from None
    except OSError as e:
        raise TesseraError(f"{what} could not run ({argv[0]}): {e}") from None
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).decode(errors="replace").strip()
        raise TesseraError(f"{what} failed (exit {proc.returncode}): {err}")
    return proc


def assemble(bytecode: bytes, arch: str = "sm_90", opt_level: int = 3, extra_args: tuple[str, ...] = (),
             timeout: float = 300.0) -> bytes:
    """Assemble Tile IR bytecode to a cubin for `arch` (e.g. "sm_90", "sm_100") with tileiras."""
    tileiras = require_tool("tileiras")
    with tempfile.TemporaryDirectory(prefix="tessera-tileir-") as tmp:
        src, dst = os.path.join(tmp, "kernel.tilebc"), os.path.join(tmp, "kernel.cubin")
        with open(src, "wb") as f:
            f.write(bytecode)
        _run([tileiras, f"--gpu-name={arch}", f"--opt-level={opt_level}", *extra_args, "-o", dst, src],
             f"tileiras --gpu-name={arch}", timeout)
        with open(dst, "rb") as f:
            cubin = f.read()
    if not cubin:
        raise TesseraError(f"tileiras --gpu-name={arch} wrote an empty cubin")
    return cubin


def disassemble(bytecode: bytes, timeout: float = 60.0) -> str:
    """The MLIR text of Tile IR bytecode, as tileirdisasm prints it."""
    tool = require_tool("tileirdisasm")
    with tempfile.TemporaryDirectory(prefix="tessera-tileir-") as tmp:
        src = os.path.join(tmp, "kernel.tilebc")
        with open(src, "wb") as f:
            f.write(bytecode)
        return _run([tool, src], "tileirdisasm", timeout).stdout.decode()


def supported_versions(timeout: float = 60.0) -> list[str]:
    """The bytecode versions the installed tileiras reads ("13.1", ...)."""
    out = _run([require_tool("tileiras"), "--list-versions"], "tileiras --list-versions", timeout)
    return [line.strip() for line in out.stdout.decode().splitlines() if line.strip()]


def available() -> bool:
    """Whether tileiras is installed where `find_tool` looks."""
    return find_tool("tileiras") is not None


@functools.cache
def _version_of(path: str) -> str:
    return _run([path, "--version"], "tileiras --version", 60.0).stdout.decode().strip()


def version() -> str:
    """tileiras's `--version` text (part of every cached cubin's key)."""
    return _version_of(require_tool("tileiras"))
