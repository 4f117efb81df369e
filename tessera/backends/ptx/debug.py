"""PTX for debugging: line info, device asserts and profile stamps.

A kernel without any of them is written exactly as before (`KernelDebug.of` is None), so its PTX,
and the cubin cached under it, do not change. Otherwise `KernelEmitter` asks `KernelDebug.emit`
first for every op, which

* with line info requested (the kernel's `tessera.line_info`), writes `.loc FILE LINE 0` before
  the instructions of an op whose source line (`tessera.loc`) differs from the last one named,
  the files being declared once at module scope (`.file N "path"`): ptxas -lineinfo keeps the
  table, so `nvdisasm --print-line-info`, Nsight and compute-sanitizer show the user's Python lines;
* writes `tessera_target.assert`: the condition and-ed over the thread's elements, and where it is
  false a call of CUDA's `__assertfail(message, file, line, function, char size)`, which prints
  "file:line: function: block: [..], thread: [..] Assertion `message` failed." and traps;
* writes `tessera_target.profile_begin/end`: a `%clock64` read that thread 0 of the block stores
  into its slot of the stamp buffer (a kernel parameter: [grid z, y, x, slots] of (begin, end)
  u64 stamps, typed as i32 words, `tile.PROFILE_WORDS`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xdsl.ir import Operation

from ...ir import provenance
from ...ir import target as tgt
from ...ir.provenance import Loc
from ...lowering.assign_layouts import is_tile
from .types import PRED, S32, U64, UnsupportedByBackend

if TYPE_CHECKING:
    from .core import KernelEmitter   # (which imports this module)

#: CUDA's device-side assert, as nvcc declares it (checked against `nvcc -ptx` of `assert(x)`)
ASSERTFAIL = """.extern .func __assertfail
(
    .param .b64 __assertfail_param_0,
    .param .b64 __assertfail_param_1,
    .param .b32 __assertfail_param_2,
    .param .b64 __assertfail_param_3,
    .param .b64 __assertfail_param_4
)
;"""

_DEBUG_OPS = (tgt.AssertOp, tgt.ProfileBeginOp, tgt.ProfileEndOp)


@dataclass
class KernelDebug:
    """What one kernel's debugging output needs besides each op's instructions."""

    kernel: str
    files: dict[str, int]                  # with line info: source file -> its `.file` number
    strings: dict[str, str] = field(default_factory=dict)   # text -> its module-scope byte array
    calls_assertfail: bool = False
    last: Loc | None = None                # the line the last `.loc` named
    stamps: tuple[str, str] | None = None  # (thread 0's predicate, this block's slots' address)

    @staticmethod
    def of(kernel: tgt.KernelOp) -> KernelDebug | None:
        """The debugging state of `kernel`, or None when it has no line info and no debugging ops."""
        line_info = provenance.LINE_INFO in kernel.attributes
        if not line_info and not any(isinstance(op, _DEBUG_OPS) for op in kernel.walk()):
            return None
        files: dict[str, int] = {}
        if line_info:
            for op in kernel.walk():
                if (loc := provenance.loc_of(op)) is not None:
                    files.setdefault(loc.file, len(files) + 1)
        return KernelDebug(kernel.sym_name.data, files)

    def emit(self, e: KernelEmitter, op: Operation) -> bool:
        """Before `op`'s instructions: its `.loc` when its line differs from the last one named.
        True when `op` is a debugging op, whose instructions this writes too."""
        loc = provenance.loc_of(op)
        if self.files and loc is not None and loc != self.last:
            e.emit(f".loc {self.files[loc.file]} {loc.line} 0")
            self.last = loc
        handler = HANDLERS.get(type(op))
        if handler is None:
            return False
        handler(self, e, op)
        return True

    def directives(self) -> list[str]:
        """Module-scope lines, ahead of the kernel: the source files, __assertfail's declaration and
        the strings it is called with."""
        lines = [f".file {n} {_quoted(path)}" for path, n in self.files.items()]
        if self.calls_assertfail:
            lines.append(ASSERTFAIL)
        lines += [f".global .align 1 .b8 {name}[{len(_c_string(text))}] = {{{', '.join(map(str, _c_string(text)))}}};"
                  for text, name in self.strings.items()]
        return lines + [""] if lines else []

    def string(self, e: KernelEmitter, text: str) -> str:
        """A register holding the generic address of `text` as a NUL-terminated string."""
        name = self.strings.setdefault(text, f"tsr_{self.kernel}_str{len(self.strings)}")
        r = e.new(U64)
        e.emit(f"mov.u64 {r}, {name};")
        e.emit(f"cvta.global.u64 {r}, {r};")
        return r

    def stamp_slots(self, e: KernelEmitter, buffer) -> tuple[str, str]:
        """(thread 0's predicate, the address of this block's slots in the stamp buffer), computed at
        the kernel's entry the first time a stamp asks."""
        if self.stamps is None:
            gz, gy, gx, slots, words = buffer.type.get_shape()
            tid, leader, linear = e.new(S32), e.new(PRED), e.new(S32)
            ctaid = [e.new(S32) for _ in range(3)]
            address = e.new(U64)
            e.at_entry(f"mov.u32 {tid}, %tid.x;")
            e.at_entry(f"setp.eq.u32 {leader}, {tid}, 0;")
            for r, axis in zip(ctaid, "xyz"):
                e.at_entry(f"mov.u32 {r}, %ctaid.{axis};")
            e.at_entry(f"mad.lo.s32 {linear}, {ctaid[2]}, {gy}, {ctaid[1]};")
            e.at_entry(f"mad.lo.s32 {linear}, {linear}, {gx}, {ctaid[0]};")
            e.at_entry(f"mul.wide.u32 {address}, {linear}, {slots * words * 4};")
            e.at_entry(f"add.s64 {address}, {e.value(buffer)}, {address};")
            self.stamps = (leader, address)
        return self.stamps


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _c_string(text: str) -> bytes:
    return text.encode() + b"\0"


def _assert(d: KernelDebug, e: KernelEmitter, op: tgt.AssertOp) -> None:
    """Every element of the thread's condition holds, or `__assertfail` reports and traps."""
    regs = e.regs_of(op.condition) if is_tile(op.condition) else [e.value(op.condition)]
    ok = regs[0]
    for r in regs[1:]:
        both = e.new(PRED)
        e.emit(f"and.pred {both}, {ok}, {r};")
        ok = both
    passed = e.label("assert_ok")
    e.emit(f"@{ok} bra {passed};")
    loc = provenance.loc_of(op)
    message, file, function = (d.string(e, text) for text in
                               (op.message.data, loc.file if loc else "<unknown>", d.kernel))
    args = [("b64", message), ("b64", file), ("b32", str(loc.line if loc else 0)), ("b64", function), ("b64", "1")]
    e.emit("{")
    for i, (ty, value) in enumerate(args):
        e.emit(f"    .param .{ty} assert_param{i};")
        e.emit(f"    st.param.{ty} [assert_param{i}], {value};")
    e.emit(f"    call __assertfail, ({', '.join(f'assert_param{i}' for i in range(len(args)))});")
    e.emit("}")
    e.lines.append(f"{passed}:")
    d.calls_assertfail = True


def _stamp(which: int) -> Callable:
    """A profile stamp: thread 0 stores `%clock64` into stamp `which` (0: begin, 1: end) of its slot,
    8 bytes each."""
    def handle(d: KernelDebug, e: KernelEmitter, op: tgt.ProfileBeginOp | tgt.ProfileEndOp) -> None:
        if not op.buffer:
            raise UnsupportedByBackend(f"PTX backend: {op.name} {op.label.data!r} has no stamp buffer "
                                       f"(kernel {d.kernel})")
        leader, slots = d.stamp_slots(e, op.buffer[0])
        clock = e.new(U64)
        e.emit(f"mov.u64 {clock}, %clock64;")
        e.emit(f"@{leader} st.global.u64 [{slots}+{8 * (2 * op.slot.value.data + which)}], {clock};")
    return handle


HANDLERS: dict[type, Callable] = {
    tgt.AssertOp: _assert,
    tgt.ProfileBeginOp: _stamp(0),
    tgt.ProfileEndOp: _stamp(1),
}
