"""The Python values a traced function reads besides its arguments, as part of its compile key.

A trace runs the user's function once and keeps what it computed: a global
`scale`, a closure variable or a config object's attribute read during the
trace is baked into the kernels. So a call keys its compile cache on the
values of every global and closure variable the function's code (and its
nested functions', and the same module's helper functions') names, read
afresh per call: a changed value re-traces. Values are keyed as they compare:
numbers, strings, dtypes and containers of them by value, an object by the
values of its attributes, a module, class or function by identity, and each
attribute the code reads of a module or class it names (`cfg.SCALE`,
`Knobs.GAIN`) that holds such a value, as a variable of its own. A value no
key can stand for (a large array, a tensor of another framework) is refused
with the variable's name instead of being frozen silently.
"""
from __future__ import annotations

import dis
import enum
import types
from typing import Any, Callable, NamedTuple

import numpy as np

from ..dtypes import DType
from ..errors import ArgumentKindError

#: Values keyed as they are (they hash and compare by value).
_VALUES = (type(None), bool, int, float, complex, str, bytes, DType, np.generic, np.dtype, enum.Enum, range)
#: Values keyed by identity: what they are, not what they hold, is what a trace uses.
_IDENTITIES = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
               types.BuiltinMethodType, types.MethodWrapperType, types.WrapperDescriptorType, property)
#: Limits past which a value is refused rather than keyed (a key is built on every call).
MAX_ARRAY_BYTES = 4096
MAX_ITEMS = 1024
MAX_DEPTH = 4

#: what reading an unassigned closure variable or a deleted global gives
MISSING = _MISSING = object()


class ObjectIdentity(int):
    """The id() of a config object in a key: it compares as the int, but marks a part of the key
    that holds only within this process, which a key meant for disk (runtime/warm.py) leaves out."""


class Captures:
    """The globals and closure variables `fn` reads; `key()` is their values, frozen for a dict key."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self._plan: list[_Variable] | None = None
        #: (plan, the values read, their key) when every value is immutable or keyed by identity: a
        #: call that reads the same objects again returns that key object itself, unfrozen (freezing
        #: a layer_norm's took 2 us), and the launch fast path guards those objects (`identity_guards`)
        self._last: tuple[list, list, tuple] | None = None

    def key(self) -> tuple:
        """The values now, frozen; re-plans when a helper function it looked into was rebound."""
        plan = self._plan
        if plan is None:
            plan = self._plan = _plan(self.fn)
        raw = [v.read() for v in plan]
        last = self._last
        if last is not None and last[0] is plan and all(a is b for a, b in zip(raw, last[1])):
            return last[2]
        values = []
        for variable, value in zip(plan, raw):
            if variable.helper is not None and not _still(value, variable.helper, self.fn):   # (its reads differ)
                self._plan = None
                return self.key()
            values.append(freeze(value, variable.label))
        key = tuple(values)
        self._last = (plan, raw, key) if all(_same_when_identical(v) for v in raw) else None
        return key

    def identity_guards(self, key: tuple) -> tuple | None:
        """What the launch fast path (runtime/fastcall.py) checks instead of `key()`, for `key` (one
        `key()` returned): per variable, ("global", its module's dict, name, value) or ("cell", the
        cell, value), the value `key` was made of (`MISSING` where absent), each to be the same
        object again. None when some value is not keyed by identity alone (a list, a config object:
        their contents can change while they stay the same object), or when a later `key()` (another
        thread's) replaced `key`'s values."""
        last = self._last
        if last is None or last[2] is not key:
            return None
        plan, raw, _ = last
        if any(v.source is None for v in plan):   # (a class's attribute: no dict entry to guard)
            return None
        return tuple((*v.source, value) for v, value in zip(plan, raw))


class _Variable(NamedTuple):
    label: str
    read: Callable[[], Any]
    helper: Any                  # the helper function looked into, the helpers a container holds (`_Held`),
                                 # or the module or class whose attributes are read: what changes the plan
                                 # when the variable no longer holds it (`_still`)
    source: tuple | None         # ("global", module dict, name) or ("cell", cell); None: a class's attribute


def _plan(fn: Callable) -> list[_Variable]:
    """Each variable `fn` reads: its closure cells, the globals its code names (nested code objects
    included), and, through helper functions of its own module, theirs."""
    plan: list = []
    seen_code: set = set()
    seen_vars: set = set()

    def visit(f) -> None:
        if f.__code__ in seen_code:
            return
        seen_code.add(f.__code__)
        reads = _attribute_reads(f.__code__)
        cells = dict(zip(f.__code__.co_freevars, f.__closure__ or ()))
        for name, cell in cells.items():
            owner = _attribute_owner(_cell_value(cell), [c for n, c in reads if n == name])
            add(("cell", id(cell)), f"{fn.__name__} reads closure variable {name!r}{through(f)}",
                _cell_reader(cell), _cell_value(cell), ("cell", cell), owner)
        module_globals = f.__globals__
        for name in _global_names(f.__code__):
            if name in module_globals:
                owner = _attribute_owner(module_globals[name], [c for n, c in reads if n == name])
                add(("global", id(module_globals), name), f"{fn.__name__} reads global {name!r}{through(f)}",
                    _global_reader(module_globals, name), module_globals[name], ("global", module_globals, name),
                    owner)
        for name, chain in reads:
            owner = _cell_value(cells[name]) if name in cells else module_globals.get(name)
            for end in range(1, len(chain) + 1):   # cfg.X, Knobs.Sub.G: each value a path of them holds
                if _attribute_owner(owner, (chain[:end],)) is None:
                    continue
                label = f"{fn.__name__} reads {'.'.join((name, *chain[:end]))}{through(f)}"
                source = ("global", vars(owner), chain[0]) if end == 1 and isinstance(owner, types.ModuleType) \
                    else None
                add(("attr", id(owner), chain[:end]), label, _attribute_reader(owner, chain[:end]),
                    _attribute_reader(owner, chain[:end])(), source)

    def through(f) -> str:
        return "" if f is fn else f" (in {f.__name__})"

    def add(identity, label, read, value, source, owner=None) -> None:
        if identity in seen_vars:
            return
        seen_vars.add(identity)
        held = _Held(_helpers_held(value, fn)) if isinstance(value, (list, tuple, dict)) else None
        helper = value if _is_helper(value, fn) else held if held is not None else owner
        plan.append(_Variable(label, read, helper, source))
        for f in (value,) if _is_helper(value, fn) else held or ():
            visit(f)

    visit(fn)
    return plan


def _attribute_reads(code: types.CodeType) -> list[tuple[str, tuple[str, ...]]]:
    """(variable, attribute path) for each `name.a.b...` `code` and the code objects nested in it
    read of a global or closure variable: a LOAD_GLOBAL or LOAD_DEREF followed by LOAD_ATTRs."""
    found, chain = [], None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain is not None:
            chain[1].append(ins.argval)
            continue
        if chain is not None and chain[1]:
            found.append((chain[0], tuple(chain[1])))
        chain = (ins.argval, []) if ins.opname in ("LOAD_GLOBAL", "LOAD_DEREF") else None
    if chain is not None and chain[1]:
        found.append((chain[0], tuple(chain[1])))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.extend(_attribute_reads(const))
    return found


def _attribute_owner(value, paths) -> Any:
    """`value` where it is a module or class through which (and through the modules and classes
    on the way) one of the attribute `paths` leads to a value keyed by value (a number, a string,
    a dtype: what a trace bakes in), else None."""
    def namespace(v) -> bool:
        return isinstance(v, (types.ModuleType, type)) and v.__name__.split(".")[0] not in ("tessera", "numpy")

    def leads(path) -> bool:
        v = value
        for attr in path[:-1]:
            v = getattr(v, attr, None)
            if not namespace(v):
                return False
        return isinstance(getattr(v, path[-1], None), _VALUES)
    return value if namespace(value) and any(leads(p) for p in paths) else None


def _attribute_reader(owner, path: tuple[str, ...]) -> Callable[[], Any]:
    """Reads owner.a.b... afresh (a class on the way rebound is followed)."""
    def read():
        v = owner
        for attr in path:
            v = getattr(v, attr, _MISSING)
        return v
    return read


class _Held(tuple):
    """The helper functions a container variable held when its plan was made (`_helpers_held`)."""


def _helpers_held(value, fn) -> tuple:
    """The helper functions (`_is_helper`) a list, tuple or dict `value` holds (a table of lambdas):
    the trace may call them, so their reads are part of the key too. (One level deep.)"""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    if len(items) > MAX_ITEMS:
        return ()
    return tuple(v for v in items if _is_helper(v, fn))


def _still(value, helper, fn) -> bool:
    """Whether a variable's `value` is still what `fn`'s plan looked into: the same helper function,
    module or class, or a container holding the same helper functions (none, when it held none)."""
    if isinstance(helper, _Held):
        held = _helpers_held(value, fn)
        return len(held) == len(helper) and all(a is b for a, b in zip(held, helper))
    return value is helper


def _global_names(code: types.CodeType) -> list[str]:
    """The names `code` and the code objects nested in it (lambdas, inner functions, comprehensions)
    load, in order: globals, and attribute names, which match no global or one read needlessly."""
    names = dict.fromkeys(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(_global_names(const)))
    return list(names)


def _is_helper(value, fn) -> bool:
    """A plain function of the traced function's own module: the trace runs its code too."""
    return isinstance(value, types.FunctionType) and value.__module__ == fn.__module__


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:   # not yet assigned
        return _MISSING


def _cell_reader(cell) -> Callable[[], Any]:
    return lambda: _cell_value(cell)


def _global_reader(module_globals: dict, name: str) -> Callable[[], Any]:
    return lambda: module_globals.get(name, _MISSING)


def exact(value):
    """`value` as a key that tells apart what `==` does not but a trace may: a float's sign of
    zero (1 / -0.0 is -inf), and NaN, which `==` never finds again (a key of it would miss every
    call and grow the cache). Other values are their own keys."""
    if isinstance(value, (float, np.floating)):
        return float(value).hex()
    if isinstance(value, (complex, np.complexfloating)):
        return (float(value.real).hex(), float(value.imag).hex())
    return value


def freeze(value, label: str, depth: int = 0):
    """A hashable stand-in for `value` that differs when the trace could differ."""
    if isinstance(value, _VALUES) or value is _MISSING:
        return (type(value), exact(value))
    if isinstance(value, slice):   # (hashable only from Python 3.12)
        return (slice, freeze(value.start, label), freeze(value.stop, label), freeze(value.step, label))
    if isinstance(value, _IDENTITIES) or callable(value) and not hasattr(value, "__dict__"):
        return value
    if depth >= MAX_DEPTH:
        raise _refused(label, value, "nests too deeply")
    if isinstance(value, (tuple, list, set, frozenset)):
        if len(value) > MAX_ITEMS:
            raise _refused(label, value, f"holds {len(value)} items")
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value), tuple(freeze(v, label, depth + 1) for v in items))
    if isinstance(value, dict):
        if len(value) > MAX_ITEMS:
            raise _refused(label, value, f"holds {len(value)} items")
        return (dict, tuple((freeze(k, label, depth + 1), freeze(v, label, depth + 1)) for k, v in value.items()))
    if isinstance(value, np.ndarray):
        if value.nbytes > MAX_ARRAY_BYTES:
            raise _refused(label, value, f"is an array of {value.nbytes} bytes")
        return (np.ndarray, value.shape, str(value.dtype), value.tobytes())
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        raise _refused(label, value, "is a tensor")
    if type(value).__hash__ not in (None, object.__hash__) and type(value).__eq__ is not object.__eq__:
        return (type(value), value)   # a value type (a frozen dataclass, torch.float16)
    if depth < MAX_DEPTH - 1 and hasattr(value, "__dict__") and not type(value).__module__.startswith("tessera."):
        try:   # a config object, and one inside it (cfg.inner.scale): by its attributes' values
            return (type(value), ObjectIdentity(id(value)), freeze(vars(value), label, depth + 1))
        except ArgumentKindError:
            if depth == 0:
                raise
            return value   # (one inside whose attributes no key can stand for: by identity, as before)
    return value   # an object nested deeper, a Tessera function: by identity


def _same_when_identical(value, depth: int = 0) -> bool:
    """Whether `value`'s frozen form (`freeze`) holds while it is the same object: an immutable
    value (a tuple or frozenset of such, a torch dtype), or one keyed by identity; not a mutable
    container or a config object, whose contents can change."""
    if isinstance(value, (tuple, frozenset)):
        return depth < MAX_DEPTH and len(value) <= MAX_ITEMS and all(_same_when_identical(v, depth + 1) for v in value)
    return (isinstance(value, _VALUES) or value is _MISSING or isinstance(value, _IDENTITIES)
            or callable(value) and not hasattr(value, "__dict__")
            or type(value).__module__ == "torch" and type(value).__name__ in ("dtype", "device")
            or type(value).__module__.startswith("tessera.") and hasattr(value, "__dict__"))


def _refused(label: str, value, why: str) -> ArgumentKindError:
    return ArgumentKindError(f"{label}, which {why} ({type(value).__name__}): its value "
                             f"would be frozen into the compiled kernels, so Tessera does not key its compile cache "
                             f"on it; pass it as an argument")
