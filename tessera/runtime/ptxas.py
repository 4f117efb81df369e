"""PTX -> cubin through NVIDIA's `ptxas`, and cubin -> SASS through `cuobjdump`.

The backend writes PTX; this module turns it into a cubin the driver loads
without JIT, and reads back what ptxas reports per kernel (registers, shared
memory, stack, spills) so that tests and tools can see a schedule that spills. When
ptxas rejects the PTX the error quotes the offending PTX line, because the line
number alone points into a temp file the user never sees.
"""
from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

# Where the CUDA tools live when they are not on PATH: a toolkit install, or
# NVIDIA's pip wheels (nvidia-cuda-nvcc, nvidia-cuda-cuobjdump, ...), which put
# them in <site-packages>/nvidia/<pkg>/bin.
_TOOLKIT_DIRS = ("$CUDA_HOME/bin", "$CUDA_PATH/bin", "/usr/local/cuda/bin")


class ToolError(RuntimeError):
    """A CUDA command-line tool is missing or failed."""


class PtxasError(ToolError):
    """ptxas rejected the PTX. `diagnostics` holds (line number or None, message) per error."""

    def __init__(self, message: str, diagnostics: list[tuple[int | None, str]]):
        super().__init__(message)
        self.diagnostics = diagnostics


@dataclass(frozen=True)
class Resources:
    """What ptxas -v reports for one kernel."""

    registers: int = 0
    shared_bytes: int = 0        # static shared memory; dynamic shared memory is a launch parameter
    stack_frame_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0

    @property
    def spills(self) -> bool:
        return bool(self.spill_store_bytes or self.spill_load_bytes)


@dataclass(frozen=True)
class Assembled:
    """One ptxas run: the cubin and the per-kernel resource report."""

    cubin: bytes
    arch: str
    opt_level: int
    resources: dict[str, Resources]  # entry (kernel) name -> report
    log: str                         # ptxas's whole stderr, warnings included


# ---------------------------------------------------------------------------
# Finding the tools
# ---------------------------------------------------------------------------

def _wheel_bin_dirs() -> list[str]:
    """bin/ folders of NVIDIA's pip wheels; importing the `nvidia` namespace package is cheap."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(d for root in nvidia.__path__ for d in glob.glob(os.path.join(root, "*", "bin")))


@functools.cache
def find_tool(name: str) -> str | None:
    """Full path of CUDA tool `name` (ptxas, cuobjdump, nvdisasm), or None."""
    dirs = [os.path.expandvars(d) for d in _TOOLKIT_DIRS if "$" not in os.path.expandvars(d)]
    search = os.pathsep.join([os.environ.get("PATH", ""), *dirs, *_wheel_bin_dirs()])
    return shutil.which(name, path=search)


def available(tool: str = "ptxas") -> bool:
    """Whether `tool` can be run here."""
    return find_tool(tool) is not None


def _tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        raise ToolError(f"{name} not found on PATH, in $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin "
                        f"or NVIDIA's pip wheels; install the CUDA toolkit")
    return path


@functools.cache
def version() -> str:
    """ptxas --version's release and build lines ("Cuda compilation tools, release 13.0,
    V13.0.88; Build cuda_13.0.r13.0/compiler.36424714_0"): part of the cubin cache key."""
    out = subprocess.run([_tool("ptxas"), "--version"], capture_output=True, text=True, check=True).stdout
    wanted = [line for line in out.splitlines() if line.startswith(("Cuda compilation tools", "Build"))]
    return "; ".join(wanted) or out.strip()


# ---------------------------------------------------------------------------
# Assembling
# ---------------------------------------------------------------------------

def assemble(ptx: str, arch: str, opt_level: int = 3, line_info: bool | None = None) -> Assembled:
    """Assemble `ptx` for `arch` ("sm_90a") at ptxas -O`opt_level`, with `-lineinfo` when `line_info`
    (by default: when the PTX has `.loc` line info, so that the PTX text alone, which the cubin
    cache keys on, decides the cubin)."""
    if opt_level not in (0, 1, 2, 3):
        raise ValueError(f"ptxas opt_level must be 0, 1, 2 or 3, got {opt_level!r}")
    if line_info is None:
        line_info = has_line_info(ptx)
    with tempfile.TemporaryDirectory(prefix="tessera-ptxas-") as tmp:
        src, out = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [_tool("ptxas"), f"-arch={arch}", f"-O{opt_level}", *(["-lineinfo"] if line_info else []), "-v",
               src, "-o", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        log = proc.stderr.replace(src, "kernel.ptx")
        if proc.returncode != 0:
            raise _ptxas_error(ptx, arch, log)
        with open(out, "rb") as f:
            cubin = f.read()
    return Assembled(cubin, arch, opt_level, parse_resources(log), log)


_LOC = re.compile(r"^\s*\.loc\s", re.MULTILINE)


def has_line_info(ptx: str) -> bool:
    """Whether `ptx` carries `.loc` source line directives."""
    return _LOC.search(ptx) is not None


# ptxas -v lines. A function's properties line is indented and follows
# "Function properties for NAME"; the "Used N registers" line is flush left and
# belongs to the entry named by the last "Compiling entry function".
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FIELDS: dict[str, re.Pattern] = {
    "registers": re.compile(r"Used (\d+) registers"),
    "shared_bytes": re.compile(r"(\d+) bytes smem"),
    "stack_frame_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_store_bytes": re.compile(r"(\d+) bytes spill stores"),
    "spill_load_bytes": re.compile(r"(\d+) bytes spill loads"),
}


def parse_resources(log: str) -> dict[str, Resources]:
    """The per-entry resource report in ptxas -v output. Non-entry functions
    (called .func) are left out: their stack is counted in their callers'."""
    found: dict[str, dict[str, int]] = {name: {} for name in _ENTRY.findall(log)}
    entry = described = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
        elif m := _PROPERTIES.search(line):
            described = m.group(1)
        else:
            owner = described if line[:1].isspace() else entry
            if owner in found:
                found[owner].update({k: int(hit.group(1)) for k, p in _FIELDS.items() if (hit := p.search(line))})
    return {name: Resources(**fields) for name, fields in found.items()}


# "ptxas kernel.ptx, line 12; error   : Unknown symbol 'x'"
_DIAGNOSTIC = re.compile(r"^ptxas (?:.+?), line (\d+); (error|fatal)\s*: (.*)$")
_UNLOCATED = re.compile(r"^ptxas (error|fatal)\s*: (.*)$")


def explain(ptx: str, log: str) -> tuple[list[tuple[int | None, str]], str]:
    """ptxas's errors in `log` (from ptxas, or the driver's JIT, which runs the
    same assembler): (line or None, message) pairs, and a text that follows each
    located error with the PTX line it names."""
    lines = ptx.splitlines()
    diagnostics: list[tuple[int | None, str]] = []
    shown: list[str] = []
    for text in log.splitlines():
        if m := _DIAGNOSTIC.match(text):
            number, message = int(m.group(1)), m.group(3).strip()
            diagnostics.append((number, message))
            quoted = lines[number - 1].strip() if 0 < number <= len(lines) else "<past the end of the PTX>"
            shown.append(f"  line {number}: {message}\n    {number} | {quoted}")
        elif m := _UNLOCATED.match(text):
            diagnostics.append((None, m.group(2).strip()))
            shown.append(f"  {m.group(2).strip()}")
    return diagnostics, "\n".join(shown) or log.strip()


def _ptxas_error(ptx: str, arch: str, log: str) -> PtxasError:
    diagnostics, text = explain(ptx, log)
    return PtxasError(f"ptxas failed for {arch}:\n{text}", diagnostics)


# ---------------------------------------------------------------------------
# Disassembling
# ---------------------------------------------------------------------------

def sass(cubin: bytes) -> str:
    """The SASS of `cubin`, as `cuobjdump -sass` prints it."""
    cuobjdump = _tool("cuobjdump")
    # cuobjdump runs nvdisasm, which it looks for on PATH only.
    nvdisasm_dir = os.path.dirname(_tool("nvdisasm"))
    env = {**os.environ, "PATH": os.pathsep.join([nvdisasm_dir, os.environ.get("PATH", "")])}
    with tempfile.TemporaryDirectory(prefix="tessera-sass-") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise ToolError(f"cuobjdump -sass failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout
