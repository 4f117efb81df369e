"""The autotuner behind `@tessera.kernel.autotune(space=..., key=..., cache=...)`.

The first GPU call for a tuning key (the values of the `key` dims, the arguments' dtypes, constant
arguments, the device and the code path) compiles every point of the search space, runs it once,
checks its outputs against the first point that runs (the space's first values, unless the
backend rejects them), and times it with CUDA events
(median of `REPEATS` calls); the fastest point is kept in memory and in a JSON file under the
cache directory, so later calls and later processes use it without timing anything. A point the
backend rejects (too much shared memory, more warps than the tile has rows) or that computes
something else is skipped and reported in the results, never chosen.

Writes are atomic (a temporary file, then a rename); a cache file that cannot be read is moved
aside as `*.unreadable` and tuning starts over, so a crash or a hand edit costs a re-tune but never
a wrong or half-read entry.
"""
from __future__ import annotations

import fcntl
import hashlib
import inspect
import itertools
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .. import __version__
from ..backends import BACKEND_OPTIONS
from ..errors import TesseraError
from ..ir import schedule

log = logging.getLogger("tessera.autotune")

#: calls timed per point of the space
REPEATS = 25

#: every schedule parameter some kernel template takes, or the fusion pass derives
PARAMS = frozenset(k for defaults, _ in schedule.KINDS.values() for k in defaults) | schedule.DERIVED
BACKEND = schedule.BACKEND_PARAM


def default_directory() -> Path:
    """$TESSERA_AUTOTUNE_DIR, else ~/.cache/tessera/autotune."""
    env = os.environ.get("TESSERA_AUTOTUNE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tessera" / "autotune"


def normalize_space(space: dict, where: str) -> dict[str, tuple[int, ...]]:
    """The space with Schedule IR's parameter names (`BLOCK_M` is `block_m`) and tuples of values;
    an unknown name or a value that is not a positive int (0 or 1 for a switch; for `backend`, a
    backend's name) is an error."""
    out: dict[str, tuple] = {}
    for name, values in space.items():
        key = str(name).lower()
        if key not in PARAMS | {BACKEND}:
            raise TesseraError(f"{where}: autotune space names {name!r}, which no kernel template takes; "
                               f"known parameters: {', '.join(sorted(PARAMS | {BACKEND}))}")
        values = tuple(values) if isinstance(values, (list, tuple, range)) else (values,)
        if key == BACKEND:
            if not values or not all(v in BACKEND_OPTIONS for v in values):
                raise TesseraError(f"{where}: autotune space {name!r} must list backends "
                                   f"({', '.join(BACKEND_OPTIONS)}), got {list(values)!r}")
            out[key] = values
            continue
        allowed = (lambda v: v in (0, 1)) if key in schedule.SWITCHES else (lambda v: v >= 1)
        if not values or not all(type(v) is int and allowed(v) for v in values):
            kind = "0 or 1" if key in schedule.SWITCHES else "positive ints"
            raise TesseraError(f"{where}: autotune space {name!r} must list {kind}, got {list(values)!r}")
        out[key] = values
    return out


def points(space: dict[str, tuple[int, ...]]) -> list[dict[str, int]]:
    """Every combination of the space's values, the first values' combination first."""
    keys = list(space)
    return [dict(zip(keys, combo)) for combo in itertools.product(*space.values())]


def source_hash(fn: Callable) -> str:
    """A hash of `fn`'s source (its code object's bytes where the source is unavailable): editing
    the function starts its tuning over."""
    try:
        text = inspect.getsource(fn).encode()
    except (OSError, TypeError):
        text = fn.__code__.co_code
    return hashlib.sha256(text).hexdigest()[:16]


@dataclass
class Trial:
    """One point of the space, measured: median ms, or why it was skipped."""

    config: dict[str, int]
    ms: float | None = None
    skipped: str | None = None


@dataclass
class Tuned:
    """The outcome of tuning one key: the chosen config and every trial behind it."""

    config: dict[str, int]
    ms: float
    trials: list[Trial] = field(default_factory=list)


class TuningCache:
    """One JSON file of tuned configs per (function, source): {key: {"config", "ms"}}."""

    def __init__(self, path: Path):
        self.path = path

    def load(self) -> dict[str, dict]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:   # unreadable (permissions): tune without it, leave it alone
            log.warning("autotune cache %s cannot be read (%s); tuning without it", self.path, e)
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not all(_is_entry(v) for v in data.values()):
                raise ValueError("not a {key: {config, ms}} table")
            return data
        except ValueError as e:
            aside = self.path.with_suffix(self.path.suffix + ".unreadable")
            log.warning("autotune cache %s is unreadable (%s); moved to %s, tuning again", self.path, e, aside)
            os.replace(self.path, aside)
            return {}

    def store(self, key: str, tuned: Tuned) -> None:
        """Adds one entry: read, update and replace under an exclusive lock on a sidecar file, so
        processes tuning other keys at the same time keep theirs; the replacement is atomic."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(self.path.suffix + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = self.load()
            entries[key] = {"config": tuned.config, "ms": tuned.ms}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(entries, f, indent=1, sort_keys=True)
                os.chmod(tmp, 0o644)   # mkstemp's 0600 would hide a cache directory shared by a team
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise



def _is_entry(v) -> bool:
    return (isinstance(v, dict) and isinstance(v.get("config"), dict) and isinstance(v.get("ms"), (int, float))
            and all(isinstance(k, str) and (type(x) is int or (k == BACKEND and x in BACKEND_OPTIONS))
                    for k, x in v["config"].items()))


def host_copy(x) -> np.ndarray:
    """A CUDA array's contents on the host, as float64 (for comparing outputs without a framework)."""
    from . import driver, interop

    info = interop.describe(x, "output")
    if info.dtype is None or not info.is_contiguous:
        raise TesseraError(f"cannot read back an output of type {info.type_name} that is not contiguous")
    count = math.prod(info.shape)
    data = driver.copy_to_host(info.data_ptr, count * info.dtype.itemsize)
    return np.frombuffer(data, dtype=info.dtype.np, count=count).astype(np.float64).reshape(info.shape)


def check_same(name: str, outputs: list[np.ndarray], reference: list[np.ndarray], tolerance: float = 1e-2):
    """Raises unless each output matches the reference schedule's (relative Frobenius error below
    `tolerance`: different tilings sum in different orders, a wrong kernel is off by far more)."""
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        scale = max(float(np.linalg.norm(np.nan_to_num(ref))), 1e-30)
        err = float(np.linalg.norm(np.nan_to_num(out - ref))) / scale
        if not np.array_equal(np.isnan(out), np.isnan(ref)) or err > tolerance:
            raise TesseraError(f"{name}: output {i} differs from the first schedule's (relative error {err:.1e})")


class Autotuner:
    """Chooses a config from `space` per tuning key, by measuring, and remembers it."""

    def __init__(self, name: str, space: dict[str, tuple[int, ...]], key: tuple[str, ...],
                 cache_dir: str | os.PathLike | None, source: str):
        self.name = name
        self.space = space
        self.key = key
        directory = Path(cache_dir).expanduser() if cache_dir is not None else default_directory()
        self.cache = TuningCache(directory / f"{name}-{source}.json")
        self.results: dict[str, Tuned] = {}   # what this process measured or loaded, by key

    def tuning_key(self, dims: dict[str, int], dtypes: list[str], constants: dict, target: dict) -> str:
        """The key a tuned config is stored under: the `key` dims (every dim when `key` is empty),
        dtypes, constants, and the target (device, arch, code path, Tessera's version)."""
        unknown = [d for d in self.key if d not in dims]
        if unknown:
            raise TesseraError(f"{self.name}: autotune key names dim(s) {', '.join(unknown)}, which no "
                               f"argument annotation has; dims: {', '.join(dims)}")
        chosen = {d: dims[d] for d in (self.key or sorted(dims))}
        return json.dumps({"dims": chosen, "dtypes": dtypes, "constants": constants, "target": target,
                           "tessera": __version__}, sort_keys=True)

    def choose(self, key: str, measure: Callable[[dict[str, int]], float]) -> dict[str, int]:
        """The tuned config for `key`: remembered, cached on disk, or measured now. `measure(config)`
        returns median ms, or raises TesseraError (or a driver error) for a point it cannot run."""
        if key in self.results:
            return self.results[key].config
        entry = self.cache.load().get(key)
        if entry is not None:
            self.results[key] = Tuned(entry["config"], entry["ms"])
            return entry["config"]
        trials = []
        for config in points(self.space):
            trial = Trial(config)
            try:
                trial.ms = measure(config)
            except Exception as e:  # noqa: BLE001 - any failing point is skipped, with its reason kept
                trial.skipped = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.info("%s %s: %s", self.name, config, f"{trial.ms:.4f} ms" if trial.ms is not None else trial.skipped)
            trials.append(trial)
        timed = [t for t in trials if t.ms is not None]
        if not timed:
            reasons = "; ".join(f"{t.config}: {t.skipped}" for t in trials[:3])
            raise TesseraError(f"{self.name}: no point of the autotune space runs on this device ({reasons})")
        best = min(timed, key=lambda t: t.ms)
        tuned = Tuned(best.config, best.ms, trials)
        self.results[key] = tuned
        self.cache.store(key, tuned)
        log.info("%s: chose %s (%.4f ms of %d points)", self.name, best.config, best.ms, len(trials))
        return best.config
