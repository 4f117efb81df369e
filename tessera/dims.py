"""Dims compiled as kernel arguments: what a shape-generic compile knows of them.

A function compiles once per *specialization class* of its call (`Function.cache_info`). A dim
marked dynamic (`@tsr.function(dynamic=["M"])`, or found to vary between calls) is traced and
lowered as a `Dynamic`: its value is not known to the compile, only that it is at least 2 (a
dim of 1 broadcasts, so it is specialized as 1). Every step that needs the value itself
(`int()`, a comparison, a loop bound) raises `DynamicDim`, and the function then compiles that
dim as a constant; user code's sums and integer multiples of such dims (`k.shape[-2] - M`:
`frontend.tensor.DimExpr`) stay symbolic and are read at run time in tensor math (`Function._compile_generic`): the compile is generic only where
every step above the code generator was written to take the dim at run time, and a step that
was not cannot silently bake in the value of the call that happened to compile it.

Schedule choices that only affect speed (a tile height, a grid order, how many ways a GEMM's K
is split) read `hint`, the representative value of the dim's class (`CLASSES`), so one class
compiles to the same kernels whatever call compiled it.
"""
from __future__ import annotations

import math

from .errors import ShapeError, TesseraError

#: the longest dim a kernel takes: one dim's indices, and a tile's reach past the end, are 32-bit
#: integers in the generated code (a whole tensor may have more elements: addresses are 64-bit)
MAX_DIM = 2 ** 31 - 2 ** 16

#: element offsets below this are summed in 32-bit integers (`ptx.core.KernelEmitter.element_address`)
INDEX_LIMIT = 2 ** 31

#: the value schedule choices assume for a dynamic dim of the largest class (a prompt, a batch of tokens)
HINT = 4096

#: a dynamic dim's specialization classes (`class_of`): (the largest value of the class, the hint its
#: compile's schedule choices read). A decode step's few rows and a prompt's thousands want different
#: schedules: tiles are powers of two cut to the dim (`schedule.fit_block`), so a GEMM of 8 rows takes
#: 16-row tiles on mma.sync and splits its K four ways, one of 100 rows 64 x 128 wgmma tiles split
#: four ways, one of 4096 rows 128 x 256 tiles whole (H200 bf16, K = N = 4096). Classes end at the
#: powers of two where those choices change, each compiled for its largest value, so every value
#: of a class gets the schedule of the class's top; past 1024 the choices settle. A sweep over any
#: values costs at most len(CLASSES) compiles
CLASSES = ((16, 16), (32, 32), (64, 64), (128, 128), (256, 256), (512, 512), (1024, 1024), (MAX_DIM, HINT))

#: a dynamic dim whose value is a multiple of this is a class of its own (`class_of`: "dynamic%128"),
#: as Triton specializes an integer argument divisible by 16: its kernels know that no tile of up
#: to ALIGNMENT along it is partial, so a loop over its blocks cuts none (`whole_blocks`). A function
#: none of whose kernels relies on it (a GEMM, a norm) keys that dim without it after its first
#: such compile (`Specialization.unaligned`), so the class costs no compile there. The largest
#: tile a loop walks a dim by is 128 (attention's key and query blocks); before this class the
#: attention backward's generic kernels cut a column tail in every block, 1.085-1.100x the
#: specialized kernels at S = 4096 and 8192 (H200 bf16; 1.009-1.018 without the cut). A sweep of
#: random values meets a multiple of 128 in one value of 128: it adds a compile a class at most
ALIGNMENT = 128

#: the most compiles a sweep of a dynamic dim over every value costs: one a class, and one more a
#: class whose values include multiples of ALIGNMENT
MOST_CLASSES = len(CLASSES) + sum(1 for largest, _ in CLASSES if largest >= ALIGNMENT)


class DynamicDim(TesseraError):
    """A compile step needed the value of dim `dim`, which the compile takes at run time."""

    def __init__(self, dim: str, why: str = "its value was needed at compile time"):
        super().__init__(f"dim {dim!r} is dynamic, but {why}")
        self.dim = dim


class Dynamic:
    """A dynamic dim's stand-in for its value in dim bindings (`tessera.ir.graph.bindings_of`)."""

    __slots__ = ("name", "hint", "index_bits", "multiple", "relied_on")

    def __init__(self, name: str, hint: int = HINT, index_bits: int = 64, multiple: int = 1):
        #: 32 where every tensor of the call has fewer than 2^31 elements (`index_bits`): the
        #: kernels then sum element offsets in 32-bit integers, as for a dim of known size
        self.name, self.hint, self.index_bits = name, hint, index_bits
        #: what every value the compile serves is a multiple of: ALIGNMENT or 1 (`multiple_of`)
        self.multiple = multiple
        #: whether a kernel's code depends on `multiple` (`whole_blocks`: a multiple of ALIGNMENT
        #: would make, or made, its blocks whole): its host function's `tessera.dim_multiples` names it
        self.relied_on = False

    def __repr__(self) -> str:
        return f"{self.name}=?" if self.multiple == 1 else f"{self.name}=?%{self.multiple}"

    def __hash__(self) -> int:   # a set or dict lookup compares hashes, never asking __eq__
        raise DynamicDim(self.name, "a set or dict lookup needs its value")

    def __eq__(self, other) -> bool:
        if other is None:   # (a size left to infer)
            return False
        if isinstance(other, Dynamic):   # two dynamic dims: equal only by name (values unknown)
            if other.name != self.name:
                raise DynamicDim(self.name, f"a comparison with dynamic dim {other.name!r} needs their values")
            return True
        if other in (0, 1):   # a dynamic dim is at least 2 (`class_of`)
            return False
        raise DynamicDim(self.name, f"a comparison with {other!r} needs its value")

    def __ne__(self, other) -> bool:
        return not self == other

    def _value(self, *_):
        raise DynamicDim(self.name)

    __int__ = __index__ = __float__ = __bool__ = _value
    __lt__ = __le__ = __gt__ = __ge__ = _value
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _value
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = _value
    __neg__ = __pow__ = __rpow__ = _value


def is_dynamic(value) -> bool:
    return isinstance(value, Dynamic)


def hint(value) -> int:
    """A dim's value for a choice that only affects speed: a dynamic dim's `hint`, else the value."""
    return value.hint if isinstance(value, Dynamic) else value


def least(value) -> int:
    """A dim's smallest value: a dynamic dim's class's (2 in the first class, else one past the
    class before, rounded up to the dim's multiple), else the value. For a speed choice that costs
    far more where a value falls below its assumption than above it: a split-KV attention split for
    a class's top leaves most SMs idle at its bottom (B = 2 of the class 2..16: 16 blocks on 132
    SMs), while one split for its bottom costs the top a few partial rows more."""
    if not isinstance(value, Dynamic):
        return value
    i = next(i for i, (_, h) in enumerate(CLASSES) if h == value.hint)
    low = CLASSES[i - 1][0] + 1 if i else 2
    return -(-low // value.multiple) * value.multiple


def whole_blocks(block: int, value) -> bool:
    """Whether tiles of `block` along a dim of `value` are all whole: a constant's that `block`
    divides, or a dynamic dim's whose values are all multiples of a multiple of `block`. Where a
    multiple of ALIGNMENT would decide it, the dynamic dim notes that the code depends on its
    multiple (`Dynamic.relied_on`)."""
    if not isinstance(value, Dynamic):
        return value % block == 0
    if ALIGNMENT % block == 0:
        value.relied_on = True
    return value.multiple % block == 0


def whole_if_relied_on(block: int, value) -> bool:
    """Whether tiles of `block` along a dim of `value` are all whole where the compile already
    depends on the dim's multiple (a loop's `whole_blocks` relied on it first): a constant's that
    `block` divides, a dynamic dim's only then, so that a copy's bounds checks (a tile wholly
    inside or wholly past the end) never make a compile depend on the multiple on their own (a
    GEMM's rows would then compile a class more for nothing its loop gains)."""
    if not isinstance(value, Dynamic):
        return value % block == 0
    return value.relied_on and value.multiple % block == 0


def multiple_of(value: int) -> int:
    """What a dynamic dim compiled for `value`'s class promises its values are a multiple of."""
    return ALIGNMENT if value % ALIGNMENT == 0 else 1


def unbounded(value) -> bool:
    """Whether `value` is a dynamic dim of the last class (`CLASSES`), which has no largest value
    below MAX_DIM: a choice its class's top would decide must hold at any size instead."""
    return isinstance(value, Dynamic) and value.hint == CLASSES[-1][1]


class OffsetWidthError(ShapeError):
    """A call of a 32-bit-offset generic compile with a buffer of 2^31 elements or more (an output
    a broadcast made larger than every input): `Function` then compiles with 64-bit offsets."""


def index_bits(arrays) -> int:
    """32 when each array has fewer than 2^31 elements, else 64: the offset width a generic
    kernel's addressing takes, part of its specialization key (a kernel of 32-bit offsets over a
    tensor of 2^31 elements would wrap; a call whose outputs are that large although its inputs
    are not raises `OffsetWidthError`, and the function compiles with 64-bit offsets)."""
    return 32 if all(math.prod(x.shape) < INDEX_LIMIT for x in arrays) else 64


def class_of(value: int, aligned: bool = True):
    """The specialization class of a dynamic dim's value: 0 and 1 are their own (a zero-size call
    launches nothing; a dim of 1 broadcasts); every other value is in one of `CLASSES`, named by
    its largest value ("dynamic" for the last: any value past the others), and within it the
    multiples of ALIGNMENT are a class of their own ("dynamic<=1024%128"), unless not `aligned`
    (a function whose kernels do not rely on it)."""
    if value < 2:
        return value
    bound = next((largest for largest, _ in CLASSES[:-1] if value <= largest), None)
    name = "dynamic" if bound is None else f"dynamic<={bound}"
    return name if not aligned or multiple_of(value) == 1 else f"{name}%{ALIGNMENT}"


def hint_of(value: int) -> int:
    """The hint of the class of a dynamic dim's value (`CLASSES`; a value past MAX_DIM is the last
    class's, and `bind_shapes` refuses it with a ShapeError naming the argument)."""
    return next((h for largest, h in CLASSES[:-1] if value <= largest), CLASSES[-1][1])


def bind_shapes(fn_name: str, declared: list[tuple], given: list[tuple], names: list[str],
                bits: int = 64, multiples: dict[str, int] | None = None) -> list[tuple]:
    """Every buffer's shape for one call: `declared` (each input's, then each other buffer's, a
    dynamic dim as its name) bound by the inputs' `given` shapes. An input whose shape differs
    from its declared one where it is static, or that disagrees with another on a dim, or whose
    dynamic dim is not a multiple of what the compile took it as (`multiples`), or a buffer too
    large for the compile's 32-bit offsets (`bits`), is a `ShapeError` naming the argument
    (before anything launches)."""
    from .errors import ShapeError

    values: dict[str, tuple[int, str]] = {}
    for name, want, got in zip(names, declared, given):
        got = tuple(int(n) for n in got)
        if len(got) != len(want):
            raise ShapeError(f"{fn_name}: argument {name!r} has shape {got}, compiled for {_shown(want)}")
        for axis, (w, n) in enumerate(zip(want, got)):
            if isinstance(w, str):
                if not 2 <= n < MAX_DIM:
                    raise ShapeError(f"{fn_name}: argument {name!r} has {w}={n}; this compile takes "
                                     f"2 <= {w} < {MAX_DIM}")
                multiple = (multiples or {}).get(w, 1)
                if n % multiple:
                    raise ShapeError(f"{fn_name}: argument {name!r} has {w}={n}; this compile takes {w} a "
                                     f"multiple of {multiple}")
                first = values.setdefault(w, (n, name))
                if first[0] != n:
                    raise ShapeError(f"{fn_name}: argument {name!r} has {w}={n} but argument {first[1]!r} "
                                     f"has {w}={first[0]}")
            elif w != n:
                raise ShapeError(f"{fn_name}: argument {name!r} has shape {got}, compiled for {_shown(want)}")
    shapes = [tuple(values[n][0] if isinstance(n, str) else n for n in shape) for shape in
              (*given, *declared[len(given):])]
    if bits == 32:
        for shape, want in zip(shapes, declared):
            if any(isinstance(n, str) for n in want) and math.prod(shape) >= INDEX_LIMIT:
                raise OffsetWidthError(f"{fn_name}: a buffer of shape {shape} has 2^31 elements or more, past "
                                       f"the 32-bit offsets this compile takes (a call of the function compiles "
                                       f"with 64-bit offsets)")
    return shapes


def _shown(shape: tuple) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ")"


def launch_grid(constants, terms, shapes) -> tuple[int, int, int]:
    """A launch's grid for buffers of these shapes: each axis's constant times its terms'
    cdiv(size, block), a term (axis, buffer, dim, block) (`tile.LaunchOp.grid_dims`)."""
    grid = list(constants)
    for axis, arg, dim, block in terms:
        grid[axis] *= -(-shapes[arg][dim] // block)
    return tuple(grid)
