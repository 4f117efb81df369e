"""Caches between PTX and a launchable kernel.

`CubinCache` keeps assembled cubins on disk (default ~/.cache/tessera/cubin,
or $TESSERA_CACHE_DIR), keyed by everything that determines ptxas's output,
each with ptxas's log beside it, so a cached kernel still has its resource
report. Entries are written atomically and checked when read, so a crash or a
full disk can cost a rebuild but never loads a broken cubin into the driver.

`FunctionCache` keeps loaded kernels in memory per (cubin, device, name):
loading a module costs far more than a launch.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from . import driver, ptxas

ELF_MAGIC = b"\x7fELF"


def default_directory() -> Path:
    """$TESSERA_CACHE_DIR, else ~/.cache/tessera/cubin."""
    env = os.environ.get("TESSERA_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tessera" / "cubin"


def cache_key(ptx: str, arch: str, opt_level: int, ptxas_version: str) -> str:
    """sha256 over every input of the cubin; JSON so no two inputs encode the same."""
    payload = json.dumps([ptx, arch, opt_level, ptxas_version]).encode()
    return hashlib.sha256(payload).hexdigest()


def is_complete_elf(data: bytes) -> bool:
    """Whether `data` is a whole 64-bit little-endian ELF file (cubins are).

    Checks the magic and that the section and program header tables, which
    ptxas writes at the end of the file, lie inside it: a truncated write fails."""
    if len(data) < 64 or data[:4] != ELF_MAGIC or data[4:6] != b"\x02\x01":
        return False
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum) <= len(data)


class CubinCache:
    """An on-disk cubin store: per entry `<key>.cubin`, ptxas's log as `<key>.log` and the cubin's
    SHA-256 as `<key>.sha256`, checked on every read: the key hashes what made the cubin, not the
    cubin, so only the digest tells a damaged file (a flipped byte passes the ELF check) from a
    good one."""

    def __init__(self, directory: str | os.PathLike | None = None,
                 assemble: Callable[[str, str, int], ptxas.Assembled] = ptxas.assemble,
                 ptxas_version: Callable[[], str] = ptxas.version):
        self.directory = Path(directory) if directory is not None else default_directory()
        self._assemble = assemble
        self._ptxas_version = ptxas_version

    def key(self, ptx: str, arch: str, opt_level: int = 3) -> str:
        return cache_key(ptx, arch, opt_level, self._ptxas_version())

    @staticmethod
    def key_of(inputs: list) -> str:
        """The key of a cubin another assembler made from `inputs` (JSON values: its source, arch,
        options and the assembler's version), in the same store as ptxas's."""
        return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.cubin"

    def log_path(self, key: str) -> Path:
        return self.directory / f"{key}.log"

    def digest_path(self, key: str) -> Path:
        return self.directory / f"{key}.sha256"

    def get(self, key: str) -> bytes | None:
        """The cached cubin, or None when absent or broken: not a whole ELF file, or not the bytes
        its digest names (a broken entry is removed, and rebuilt by the caller)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            digest = self.digest_path(key).read_text().strip()
        except FileNotFoundError:
            digest = None
        if is_complete_elf(data) and digest == hashlib.sha256(data).hexdigest():
            return data
        path.unlink(missing_ok=True)
        return None

    def get_log(self, key: str) -> str | None:
        """ptxas's log of the entry, or None when absent (an entry cached without one)."""
        try:
            return self.log_path(key).read_text()
        except FileNotFoundError:
            return None

    def put(self, key: str, cubin: bytes, log: str | None = None) -> Path:
        """Store `cubin` (and ptxas's `log`, first) atomically: readers see the old entry, no entry,
        or the whole new one."""
        if not is_complete_elf(cubin):
            raise ValueError("refusing to cache data that is not a complete ELF cubin")
        self.directory.mkdir(parents=True, exist_ok=True)
        if log is not None:
            self._write_atomically(self.log_path(key), log.encode())
        self._write_atomically(self.digest_path(key), hashlib.sha256(cubin).hexdigest().encode())
        self._write_atomically(self.path(key), cubin)
        return self.path(key)

    def _write_atomically(self, path: Path, data: bytes) -> None:
        """Write through a temp file in the same directory, then rename it over `path`."""
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.stem[:16]}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def assembled(self, ptx: str, arch: str, opt_level: int = 3) -> ptxas.Assembled:
        """`ptx` assembled, with ptxas's resource report: from the cache, else by ptxas and stored."""
        key = self.key(ptx, arch, opt_level)
        cubin, log = self.get(key), self.get_log(key)
        if cubin is not None and log is not None:
            return ptxas.Assembled(cubin, arch, opt_level, ptxas.parse_resources(log), log)
        assembled = self._assemble(ptx, arch, opt_level)
        self.put(key, assembled.cubin, assembled.log)
        return assembled

    def cubin(self, ptx: str, arch: str, opt_level: int = 3) -> bytes:
        """The cubin for `ptx`: from the cache, else assembled and stored."""
        return self.assembled(ptx, arch, opt_level).cubin


class FunctionCache:
    """Loaded kernels per (sha256 of the cubin, device ordinal, kernel name).

    Modules are shared by the kernels of one cubin, and never unloaded: the
    process keeps every kernel it has launched, as a JIT cache would."""

    def __init__(self):
        self._modules: dict[tuple[str, int], driver.Module] = {}
        self._kernels: dict[tuple[str, int, str], driver.Kernel] = {}
        self._lock = threading.Lock()

    def kernel(self, cubin: bytes, name: str, device: int = 0) -> driver.Kernel:
        """The loaded kernel `name` of `cubin` on `device`."""
        digest = hashlib.sha256(cubin).hexdigest()
        with self._lock:
            found = self._kernels.get((digest, device, name))
            if found is None:
                module = self._modules.get((digest, device))
                if module is None:
                    module = self._modules[(digest, device)] = driver.Module.from_cubin(cubin, device)
                found = self._kernels[(digest, device, name)] = module.function(name)
        return found

    def __len__(self) -> int:
        return len(self._kernels)


#: The process's loaded kernels.
functions = FunctionCache()


def kernel_from_ptx(ptx: str, name: str, arch: str, opt_level: int = 3, device: int = 0) -> driver.Kernel:
    """PTX to a launchable kernel through both caches (the disk cache at its
    default place, read from the environment now)."""
    return functions.kernel(CubinCache().cubin(ptx, arch, opt_level), name, device)
