"""NVIDIA's cuTile Python samples against Tessera's PTX and CUDA Tile IR backends (issue 18): the
same shapes and inputs, one process.

    # on a machine with tileiras and `pip install cuda-tile` (no GPU needed): compile the samples'
    # kernels for sm_90a into $TESSERA_CACHE_DIR/cutile_samples/ (cubins + manifest.json), and
    # Tessera's own cuda-tile cubins for the same cases into $TESSERA_CACHE_DIR
    TESSERA_CACHE_DIR=DIR python3 bench/cutile_samples.py --prebuild --samples PATH
    # on the H100/H200 (no tileiras, no cuda.tile needed)
    TESSERA_CACHE_DIR=DIR python3 bench/cutile_samples.py
    # anywhere: check the prebuilt launch plans against the cubins' parameter tables, no GPU
    TESSERA_CACHE_DIR=DIR python3 bench/cutile_samples.py --dry-run

PATH (or $CUTILE_SAMPLES) is a copy of github.com/NVIDIA/cutile-python: a checkout, its samples/
folder, or a bare git directory (its samples/ are taken with `git archive HEAD`). Nothing of NVIDIA's code is
kept here: --prebuild imports the two sample files from PATH and compiles their kernels with
cuda.tile's ahead-of-time API (`cuda.tile.compilation.export_kernel`), recording the commit and
the files' sha256 in the manifest; the GPU run only reads the cubins and the manifest.

The sample kernels (samples/ of NVIDIA/cutile-python; first prebuilt from commit
9c3ee3ccc504f18bbabf55b0d3e6d398bb21ecc4 with cuda-tile 1.7.0 and tileiras 13.5):

- MatMul.py `matmul_kernel`: C = A @ B, A [M, K], B [K, N], C [M, N], all row-major, fp32
  accumulation, C in the inputs' dtype. Tiles as the sample's wrapper `cutile_matmul` picks them
  for 2-byte dtypes: 128 x 256 x 64. A 1-D grid of ceil(M/128) * ceil(N/256) blocks, each mapped
  to an output tile in groups of 8 tile rows. Same work as Tessera's `gemm` (tsr.matmul).
- MatMul.py `persistent_matmul_kernel`: the same tiles; a grid of min(#SMs, tiles), each block
  walking tiles (the wrapper's persistent=True).
- AttentionFMHA.py `fmha_kernel`: Out = softmax(Q K^T * qk_scale) V per (batch, head), Q, K, V,
  Out [B, H, S, D] contiguous, qk_scale = 1/sqrt(D) (the wrapper's default), an online softmax in
  base 2 (the scale times 1/ln 2 is folded in, fp32 statistics and accumulator, probabilities cast
  to the inputs' dtype for the P V product, division by the row sum at the end), input_pos = 0,
  query_group_size = 1 (no GQA). Causal masks keys j > query i. A grid of (ceil(S/TILE_M), B*H, 1).
  Same work as Tessera's `attention_cases.plain` / `causal`.
  Configurations: the wrapper's default, TILE_M = TILE_N = 128 with the decorator's occupancy = 2
  hint, and (unless --fmha-configs default) the single-CTA entries of the sample's own autotuning
  search space (`tune_cutile_fmha`, read from the sample at prebuild). The table shows the
  default and the fastest configuration. Entries with num_ctas > 1 (several CTAs per block, a
  cluster launch this script does not reproduce) are left out.

ABI of the compiled kernels (cuTile's `cutile_python_v1` calling convention, checked at prebuild
against the entry signature and the cubin's parameter table): parameters in the Python kernel's
order, `ct.Constant` parameters compiled in and absent; each array is 1 + 2 * ndim params: the
device pointer (8 bytes), then its shape and its strides in elements (int32 each, the last stride
too although the kernel takes it as 1); a Python float is an f32, an int an int32. The signature
compiled is the one cuda.tile's `ct.launch` JIT derives for contiguous torch tensors (int32
indices, last stride 1, 16-byte divisible strides and base pointers, dims marked divisible by 16
where they are, no aliasing), so each cubin is the kernel `ct.launch` would run for these shapes;
the run checks its tensors meet those assumptions before launching.

Launch: the cubins are `TILEIR`-language kernels with a required block size (REQNTID in
.nv.info: 256 threads for all of these) and static shared memory only. They are launched with
the REQNTID block, as Tessera launches its own tileiras cubins, with no dynamic shared memory,
on torch's current stream, through cuda-bindings (tessera.runtime.driver); `--block one` passes
(1, 1, 1) instead, which is what cuTile's own launcher passes for these kernels.

Each row: every output is checked against torch (bench/cuda_tile.py's references, in the inputs'
dtype; relative Frobenius error in float64) before it is timed; medians of triton's do_bench in ms
(the settings of bench/cuda_tile.py); TFLOP/s; `ptx/sample` and `tile/sample` > 1 mean Tessera's
kernel is faster than the cuTile sample's.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import importlib
import importlib.util
import io
import itertools
import json
import math
import os
import struct
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from tessera.backends.cuda_tile.kernels import elf_sections, nv_info  # noqa: E402  (the cubin readers)

#: the manifest's format; a run refuses another
FORMAT = 1
#: the GPU the cubins are for (cuTile names sm_90a `sm_90`; tileiras targets the `a` features itself)
ARCH, CAPABILITY = "sm_90", (9, 0)
SUBDIR = "cutile_samples"
GEMM_LABELS = ("gemm 4096^3", "gemm 8192^3", "gemm 4000x4096x4096")
ATTENTION_LABELS = ("attention 8x16x4096x128", "causal 8x16x4096x128", "attention 16x16x2048x64")
#: the sample wrapper's GEMM tile for 2-byte dtypes (cutile_matmul), and FMHA default (cutile_fmha)
GEMM_TILE = (128, 256, 64)
#: more tiles for the sample's GEMM kernels, so the peer is its best and not only its wrapper's
#: choice (128 x 256 spills on sm_90: Tessera's own cuda-tile GEMM measured 35-65 TFLOP/s there,
#: 675 with 128 x 128; docs/CUDA_TILE.md)
GEMM_TILES = (GEMM_TILE, (128, 128, 64), (128, 128, 32), (256, 128, 64))
FMHA_DEFAULT = {"tile_m": 128, "tile_n": 128, "num_ctas": None, "occupancy": None}   # decorator's hints
#: relative Frobenius error allowed against torch, per dtype
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2}


def cache_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from tessera.runtime.cache import default_directory
    return default_directory() / SUBDIR


def tessera_bench():
    """bench/cuda_tile.py as a module: its CASES (labels, functions, shapes, work), torch references
    and prebuild are reused, not copied."""
    spec = importlib.util.spec_from_file_location("bench_cuda_tile", ROOT / "bench" / "cuda_tile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def our_cases(bench) -> list[tuple]:
    wanted = GEMM_LABELS + ATTENTION_LABELS
    cases = [c for c in bench.CASES if c[0] in wanted]
    assert [c[0] for c in cases] == list(wanted), "bench/cuda_tile.py's CASES changed"
    return cases


# ---------------------------------------------------------------------------
# Cubin facts (.nv.info), read without the driver
# ---------------------------------------------------------------------------

EIATTR = {"frame_size": 0x11, "regcount": 0x2F, "reqntid": 0x10, "kparam_info": 0x17, "kparam_info_v2": 0x45}


def cubin_facts(cubin: bytes, symbol: str) -> dict:
    """What the launch needs and the table reports: the entry's parameter sizes in order, its
    REQNTID, registers and stack frame (spills) per thread."""
    sections = elf_sections(cubin)
    entry = sections.get(f".nv.info.{symbol}")
    if entry is None:
        raise SystemExit(f"cubin has no kernel {symbol}")
    params, block = {}, None
    for attr, payload in nv_info(entry):
        if attr in (EIATTR["kparam_info"], EIATTR["kparam_info_v2"]):
            _, ordinal, offset, word = struct.unpack_from("<IHHI", payload)
            size = word & 0xFFFF if attr == EIATTR["kparam_info_v2"] else (word >> 18) & 0x3FFF
            params[ordinal] = (offset, size)
        elif attr == EIATTR["reqntid"]:
            block = list(struct.unpack_from("<III", payload))
    facts = {"param_sizes": [params[i][1] for i in sorted(params)],
             "param_offsets": [params[i][0] for i in sorted(params)], "block": block,
             "static_shared_bytes": len(sections.get(f".nv.shared.{symbol}", b""))}
    for attr, payload in nv_info(sections.get(".nv.info", b"")):   # one kernel per cubin here
        if attr == EIATTR["regcount"]:
            facts["registers"] = struct.unpack_from("<II", payload)[1]
        elif attr == EIATTR["frame_size"]:
            facts["frame_bytes"] = struct.unpack_from("<II", payload)[1]
    if sorted(params) != list(range(len(params))):
        raise SystemExit(f"{symbol}: parameter table has gaps: {sorted(params)}")
    return facts


# ---------------------------------------------------------------------------
# The ABI: a manifest's parameter list -> cuLaunchKernel's (type, value) pairs
# ---------------------------------------------------------------------------

#: manifest dtype names -> bytes per element
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
#: a scalar parameter's manifest type -> tessera.runtime.driver's param type
SCALAR_PARAM = {"f32": "f32", "s32": "s32", "s64": "s64"}


def flat_param_types(params: list[dict]) -> list[str]:
    types = []
    for p in params:
        if p["kind"] == "array":
            types += ["u64"] + [p["index"]] * (2 * p["ndim"])
        elif p["kind"] == "scalar":
            types.append(SCALAR_PARAM[p["type"]])
    return types


PARAM_BYTES = {"u64": 8, "s64": 8, "s32": 4, "f32": 4}


def check_array(p: dict, name: str, dtype: str, shape, strides, ptr: int) -> None:
    """Refuse an array the kernel was not compiled for (its assumptions would be undefined behavior)."""
    problems = []
    if dtype != p["dtype"] or len(shape) != p["ndim"]:
        problems.append(f"{dtype} {len(shape)}-D, kernel takes {p['dtype']} {p['ndim']}-D")
    else:
        for i, (n, s) in enumerate(zip(shape, strides)):
            if n % p["shape_divisible_by"][i]:
                problems.append(f"dim {i} = {n} not divisible by {p['shape_divisible_by'][i]}")
            if p["stride_constant"][i] is not None and s != p["stride_constant"][i]:
                problems.append(f"stride {i} = {s}, compiled as {p['stride_constant'][i]}")
            if s % p["stride_divisible_by"][i] or s < 0:
                problems.append(f"stride {i} = {s} not a non-negative multiple of {p['stride_divisible_by'][i]}")
            if not -2 ** 31 <= max(n, s) < 2 ** 31 and p["index"] == "s32":
                problems.append(f"dim/stride {i} overflows int32")
        if ptr % p["base_addr_divisible_by"]:
            problems.append(f"base address {ptr:#x} not {p['base_addr_divisible_by']}-byte aligned")
    if problems:
        raise ValueError(f"argument {name}: " + "; ".join(problems))


def launch_args(params: list[dict], arrays: dict, scalars: dict) -> list[tuple[str, object]]:
    """The kernel's arguments in the calling convention's order. `arrays`: name -> (dtype name,
    shape, strides in elements, device pointer); `scalars`: name -> value."""
    args = []
    for p in params:
        if p["kind"] == "array":
            dtype, shape, strides, ptr = arrays[p["name"]]
            check_array(p, p["name"], dtype, shape, strides, ptr)
            args += [("u64", ptr)] + [(p["index"], int(n)) for n in shape] + [(p["index"], int(s)) for s in strides]
        elif p["kind"] == "scalar":
            args.append((SCALAR_PARAM[p["type"]], scalars[p["name"]]))
    return args


def check_plan(entry: dict, args: list[tuple[str, object]]) -> None:
    """The packed arguments against the cubin's parameter table (count and each size)."""
    sizes = [PARAM_BYTES[t] for t, _ in args]
    if sizes != entry["param_sizes"]:
        raise SystemExit(f"{entry['symbol']}: arguments pack to {sizes}, the cubin's parameters are "
                         f"{entry['param_sizes']}")


def case_tensors(entry: dict) -> dict:
    """The kernel's array parameter names -> the case's argument names (the output is `out`)."""
    if entry["sample"] == "MatMul.py":
        return {"A": "a", "B": "b", "C": "out"}
    return {"Q": "q", "K": "k", "V": "v", "Out": "out"}


def case_shapes(entry: dict) -> dict:
    """The case's argument names -> shapes, the output's included."""
    shapes = {k: tuple(v) for k, v in entry["shapes"].items()}
    if entry["sample"] == "MatMul.py":
        return {**shapes, "out": (shapes["a"][0], shapes["b"][1])}
    return {**shapes, "out": shapes["q"]}


def grid_of(entry: dict, sm_count: int) -> tuple[int, int, int]:
    if entry.get("persistent_tiles"):
        return (min(sm_count, entry["persistent_tiles"]), 1, 1)
    return tuple(entry["grid"])


# ---------------------------------------------------------------------------
# --prebuild: import the samples, compile with cuda.tile's AOT API
# ---------------------------------------------------------------------------

def _git(args: list[str]) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def locate_samples(path: str | None, scratch: Path) -> tuple[Path, dict]:
    """The directory holding MatMul.py and AttentionFMHA.py, and where it came from."""
    if not path:
        raise SystemExit("--prebuild needs NVIDIA's cuTile samples: pass --samples PATH (or set CUTILE_SAMPLES) "
                         "to a copy of github.com/NVIDIA/cutile-python (a checkout, its samples/ folder, or a "
                         "bare git directory)")
    p = Path(path).resolve()
    origin = {"path": str(p), "repo": "NVIDIA/cutile-python", "commit": None}
    if (p / "objects").is_dir() and (p / "HEAD").is_file():           # a bare repository: extract samples/
        origin["commit"] = _git(["--git-dir", str(p), "rev-parse", "HEAD"])
        tar = subprocess.run(["git", "--git-dir", str(p), "archive", "--format=tar", "HEAD", "samples"],
                             capture_output=True, check=True, timeout=120).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(scratch, filter="data")
        p = scratch / "samples"
    elif (p / "samples" / "MatMul.py").is_file():
        p = p / "samples"
    if origin["commit"] is None and _git(["-C", str(p), "ls-files", "--error-unmatch", "MatMul.py"]) is not None:
        origin["commit"] = _git(["-C", str(p), "rev-parse", "HEAD"])   # a checkout that tracks the sample
        origin["remote"] = _git(["-C", str(p), "remote", "get-url", "origin"])
    missing = [f for f in ("MatMul.py", "AttentionFMHA.py") if not (p / f).is_file()]
    if missing:
        raise SystemExit(f"{path}: no {', '.join(missing)} (expected NVIDIA/cutile-python's samples/)")
    origin["files"] = {f: hashlib.sha256((p / f).read_bytes()).hexdigest() for f in ("MatMul.py", "AttentionFMHA.py")}
    return p, origin


def import_samples(directory: Path):
    sys.path.insert(0, str(directory))
    for stale in ("utils", "utils.benchmark", "MatMul", "AttentionFMHA"):
        sys.modules.pop(stale, None)
    try:
        return importlib.import_module("MatMul"), importlib.import_module("AttentionFMHA")
    except ImportError as e:
        raise SystemExit(f"importing the samples from {directory} failed ({e}); they need torch, numpy and "
                         f"cuda.tile (`python3 -m pip install cuda-tile`)")
    finally:
        sys.path.remove(str(directory))


def sample_search_space(source: str) -> list[dict]:
    """The single-CTA configurations of the FMHA sample's autotuning search space: the
    SimpleNamespace(TILE_M=..., TILE_N=..., num_ctas=..., occupancy=...) literals in its source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "SimpleNamespace":
            kw = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
            if {"TILE_M", "TILE_N", "num_ctas", "occupancy"} <= kw.keys() and kw["num_ctas"] == 1:
                found.append({"tile_m": kw["TILE_M"], "tile_n": kw["TILE_N"], "num_ctas": 1,
                              "occupancy": kw["occupancy"]})
    return found


def parse_configs(spec: str, source: str) -> list[dict]:
    configs = [dict(FMHA_DEFAULT)]
    if spec == "default":
        return configs
    if spec == "sample":
        extra = sample_search_space(source)
        if not extra:
            print("(no autotuning search space found in AttentionFMHA.py: the default configuration only)")
    else:   # e.g. 64x64o4,128x64o2
        extra = []
        for item in spec.split(","):
            tiles, _, occ = item.partition("o")
            m, n = tiles.split("x")
            extra.append({"tile_m": int(m), "tile_n": int(n), "num_ctas": 1, "occupancy": int(occ) if occ else None})
    for c in extra:
        if c not in configs:
            configs.append(c)
    return configs


#: Tile IR entry argument types -> the launch's param types
TILE_IR_PARAM = {"i32": "s32", "i64": "s64", "f32": "f32"}


def entry_param_types(mlir: str, symbol: str) -> list[str]:
    """The param types of `symbol`'s entry in tileirdisasm's text: `tile<ptr<...>>` -> u64."""
    header = next(line for line in mlir.splitlines() if line.lstrip().startswith(f"entry @{symbol}("))
    args = header[header.index("(") + 1:header.index(")", header.index("%arg"))]
    types = []
    for arg in args.split("%arg")[1:]:
        ty = arg.split(":", 1)[1].strip().rstrip(",").strip()
        types.append("u64" if ty.startswith("tile<ptr<") else TILE_IR_PARAM[ty.removeprefix("tile<").removesuffix(">")])
    return types


def config_name(c: dict) -> str:
    hints = "" if c["occupancy"] is None and c["num_ctas"] is None else f" occ{c['occupancy']}"
    return f"{c['tile_m']}x{c['tile_n']}{hints}"


def dtype_of(descs: list[dict]) -> str:
    return next(d["dtype"] for d in descs if d["kind"] == "array")


def tileiras_release(banner: str) -> str:
    """`V13.5.37` from tileiras's --version banner (the whole banner when that line is not there)."""
    line = next((x for x in banner.splitlines() if "release" in x), banner)
    return line.rsplit(",", 1)[-1].strip()


def prebuild(args) -> int:
    import cuda.tile as ct
    from cuda.tile.compilation import (ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint,
                                       export_kernel)
    from tessera.backends.cuda_tile import kernels as tile_kernels
    from tessera.backends.cuda_tile import tools

    out_dir = cache_dir(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = tessera_bench()
    cases = our_cases(bench)
    ct_dtypes = {"bf16": ct.bfloat16, "fp16": ct.float16}
    cconv = CallingConvention.cutile_python_v1()

    def array(name, dtype, shape):
        """The constraint ct.launch's JIT derives for a contiguous tensor (see the docstring), and
        the manifest's description of it."""
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        item = ITEMSIZE[dtype]
        desc = {"name": name, "kind": "array", "dtype": dtype, "ndim": len(shape), "index": "s32",
                "stride_constant": [1 if s == 1 else None for s in strides],
                "stride_divisible_by": [16 // item if s != 1 and s * item % 16 == 0 else 1 for s in strides],
                "shape_divisible_by": [16 if n % 16 == 0 else 1 for n in shape], "base_addr_divisible_by": 16}
        constraint = ArrayConstraint(ct_dtypes[dtype], len(shape), index_dtype=ct.int32, stride_lower_bound_incl=0,
                                     alias_groups=(), may_alias_internally=False,
                                     stride_constant=desc["stride_constant"],
                                     stride_divisible_by=desc["stride_divisible_by"],
                                     shape_divisible_by=desc["shape_divisible_by"], base_addr_divisible_by=16)
        return constraint, desc

    entries, compiled, abi_checked = [], {}, set()
    with tempfile.TemporaryDirectory() as scratch:
        directory, origin = locate_samples(args.samples or os.environ.get("CUTILE_SAMPLES"), Path(scratch))
        matmul, fmha = import_samples(directory)
        fmha_source = (directory / "AttentionFMHA.py").read_text()
        configs = parse_configs(args.fmha_configs, fmha_source)

        def build(kernel, kernel_name, parameters, descs, hints: dict):
            sig = KernelSignature(parameters, cconv).with_mangled_symbol(kernel_name)
            key = (sig.symbol, tuple(sorted(hints.items())))
            if key not in compiled:
                k = kernel.replace_hints(**hints) if hints else kernel
                buf = io.BytesIO()
                export_kernel(k, [sig], buf, gpu_code=ARCH, output_format="cubin")
                cubin = buf.getvalue()
                name = f"{kernel_name}-{hashlib.sha256(cubin).hexdigest()[:16]}.cubin"
                (out_dir / name).write_bytes(cubin)
                facts = cubin_facts(cubin, sig.symbol)
                threads = tile_kernels.required_threads(cubin, sig.symbol)
                if facts["block"] is None or math.prod(facts["block"]) != threads:
                    raise SystemExit(f"{sig.symbol}: REQNTID {facts['block']} vs tessera's {threads}")
                compiled[key] = {"cubin": name, "symbol": sig.symbol, **facts}
                print(f"  {name}: {threads} threads, {facts.get('registers')} registers, "
                      f"{facts.get('frame_bytes')} bytes stack/thread, {facts['static_shared_bytes']} bytes shared, "
                      f"{len(facts['param_sizes'])} params", flush=True)
            entry = {**compiled[key], "params": descs}
            check_plan(entry, [(t, 0) for t in flat_param_types(descs)])
            if (kernel_name, dtype_of(descs)) not in abi_checked:   # the entry's own signature, once per kernel and dtype
                buf = io.BytesIO()
                export_kernel(kernel, [sig], buf, gpu_code=ARCH, output_format="tileir_bytecode")
                found = entry_param_types(tools.disassemble(buf.getvalue()), sig.symbol)
                if found != flat_param_types(descs):
                    raise SystemExit(f"{sig.symbol}: entry takes {found}, the launch would pass {flat_param_types(descs)}")
                abi_checked.add((kernel_name, dtype_of(descs)))
                print(f"  entry signature ({len(found)} params) matches the calling convention", flush=True)
            return entry

        for dtype in args.dtypes.split(","):
            for label, _fn, shapes, (_unit, work) in cases:
                print(f"{label} {dtype}:", flush=True)
                base = {"label": label, "dtype": dtype, "work": work, "shapes": {k: list(v) for k, v in shapes.items()}}
                if label.startswith("gemm"):
                    (m, k), (_, n) = shapes["a"], shapes["b"]
                    built = [array("A", dtype, (m, k)), array("B", dtype, (k, n)), array("C", dtype, (m, n))]
                    for (tm, tn, tk), (kernel_name, persistent) in itertools.product(
                            GEMM_TILES, (("matmul_kernel", False), ("persistent_matmul_kernel", True))):
                        tiles = math.ceil(m / tm) * math.ceil(n / tn)
                        e = build(getattr(matmul, kernel_name), kernel_name, [c for c, _ in built] + [tm, tn, tk],
                                  [d for _, d in built], {})
                        entries.append({**base, **e, "sample": "MatMul.py", "kernel": kernel_name,
                                        "variant": f"{tm}x{tn}x{tk}" + (" persistent" if persistent else ""),
                                        "default": not persistent and (tm, tn, tk) == GEMM_TILE,
                                        "constants": {"tm": tm, "tn": tn, "tk": tk},
                                        "grid": None if persistent else [tiles, 1, 1],
                                        "persistent_tiles": tiles if persistent else None, "scalars": {}})
                else:
                    b, h, s, d = shapes["q"]
                    causal = label.startswith("causal")
                    built = [array(x, dtype, (b, h, s, d)) for x in ("Q", "K", "V", "Out")]
                    scalars = [{"name": "qk_scale", "kind": "scalar", "type": "f32"},
                               {"name": "input_pos", "kind": "scalar", "type": "s32"}]
                    for c in configs:
                        constants = {"TILE_D": d, "H": h, "TILE_M": c["tile_m"], "TILE_N": c["tile_n"],
                                     "QUERY_GROUP_SIZE": 1, "CAUSAL": causal, "EVEN_K": s % c["tile_n"] == 0}
                        hints = {k: c[k] for k in ("num_ctas", "occupancy") if c[k] is not None}
                        e = build(fmha.fmha_kernel, "fmha_kernel",
                                  [x for x, _ in built] + [ScalarConstraint(ct.float32), ScalarConstraint(ct.int32)]
                                  + list(constants.values()),
                                  [x for _, x in built] + scalars, hints)
                        entries.append({**base, **e, "sample": "AttentionFMHA.py", "kernel": "fmha_kernel",
                                        "variant": config_name(c), "default": c == FMHA_DEFAULT,
                                        "constants": constants, "hints": hints,
                                        "grid": [math.ceil(s / c["tile_m"]), b * h, 1], "persistent_tiles": None,
                                        "scalars": {"qk_scale": 1.0 / math.sqrt(d), "input_pos": 0}})

    manifest = {"format": FORMAT, "arch": ARCH, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "command": "python3 bench/cutile_samples.py " + " ".join(sys.argv[1:]),
                "cuda_tile": ct.__version__, "tileiras": tileiras_release(tools.version()),
                "calling_convention": cconv.name, "samples": origin, "entries": entries}
    old = out_dir / "manifest.json"
    if old.is_file():   # other dtypes' entries of an earlier prebuild stay
        kept = [e for e in json.loads(old.read_text()).get("entries", [])
                if e["dtype"] not in args.dtypes.split(",") and (out_dir / e["cubin"]).is_file()]
        manifest["entries"] = kept + entries
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out_dir / "manifest.json")
    used = {e["cubin"] for e in manifest["entries"]}
    for stale in out_dir.glob("*.cubin"):   # an earlier prebuild's (cubins differ run to run in debug info)
        if stale.name not in used:
            stale.unlink()
    total = sum((out_dir / f).stat().st_size for f in used)
    print(f"{len(used)} cubins ({total / 2 ** 20:.1f} MiB) and manifest.json in {out_dir}")

    if not args.samples_only:   # Tessera's cuda-tile cubins of the same cases, through bench/cuda_tile.py
        print("Tessera's cuda-tile kernels (bench/cuda_tile.py --prebuild, these cases):", flush=True)
        all_cases = bench.CASES
        try:
            bench.CASES = cases
            for dtype in args.dtypes.split(","):
                bench.prebuild(dtype)
        finally:
            bench.CASES = all_cases
    return 0


# ---------------------------------------------------------------------------
# The GPU run
# ---------------------------------------------------------------------------

def load_manifest(directory: Path) -> dict | None:
    path = directory / "manifest.json"
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"{path}: format {manifest.get('format')}, this script reads {FORMAT}: prebuild again")
    missing = sorted({e["cubin"] for e in manifest["entries"] if not (directory / e["cubin"]).is_file()})
    if missing:
        raise SystemExit(f"{directory}: cubins missing ({', '.join(missing)}): prebuild again")
    return manifest


def describe(manifest: dict) -> str:
    s = manifest["samples"]
    return (f"cuTile samples: {s['repo']} @ {(s.get('commit') or 'unknown commit')[:12]}, cuda-tile {manifest['cuda_tile']}, "
            f"tileiras {manifest['tileiras']}, {manifest['arch']}, prebuilt {manifest['created'][:19]}")


def dry_run(directory: Path, manifest: dict) -> int:
    """Every launch plan packed with fake pointers, checked against the cubin's own parameter table
    and REQNTID; no GPU, torch or cuda.tile."""
    print(f"# {describe(manifest)}")
    fake = 1 << 40
    for e in manifest["entries"]:
        cubin = (directory / e["cubin"]).read_bytes()
        facts = cubin_facts(cubin, e["symbol"])
        shapes = case_shapes(e)
        arrays = {param: (e["dtype"], shapes[arg], [math.prod(shapes[arg][i + 1:]) for i in range(len(shapes[arg]))],
                          fake + (i << 32))
                  for i, (param, arg) in enumerate(case_tensors(e).items())}
        args = launch_args(e["params"], arrays, e["scalars"])
        check_plan({**e, "param_sizes": facts["param_sizes"]}, args)
        assert facts["block"] == e["block"], (facts["block"], e["block"])
        offsets, at = [], 0
        for t, _ in args:   # natural alignment, as the cubin lays params out
            at = -(-at // PARAM_BYTES[t]) * PARAM_BYTES[t]
            offsets.append(at)
            at += PARAM_BYTES[t]
        assert offsets == facts["param_offsets"], (offsets, facts["param_offsets"])
        grid = grid_of(e, 132)
        print(f"{e['label']} {e['dtype']} {e['kernel']} {e['variant']}: grid {grid} (132 SMs), block "
              f"{tuple(e['block'])}, {e['static_shared_bytes']} B shared, {e['registers']} regs, {e['frame_bytes']} B "
              f"stack, params {''.join('p' if t == 'u64' else 'i' if t == 's32' else 'f' for t, _ in args)}: ok")
    return 0


class Launch:
    """One sample kernel on fixed tensors: arguments packed once (checked against the kernel's
    parameter sizes where the driver reports them), then each call is one cuLaunchKernel on
    torch's current stream."""

    def __init__(self, kernel, grid, block, args):
        from tessera.runtime import driver
        self.driver, self.d = driver, driver.bindings()
        self.kernel, self.grid, self.block, self.args = kernel, grid, block, args
        self.packed = driver.PackedArgs(args)
        if kernel.param_sizes is not None and kernel.param_sizes != self.packed.sizes:
            raise SystemExit(f"{kernel.name}: the driver's parameter sizes {kernel.param_sizes} differ from "
                             f"the packed {self.packed.sizes}")

    def checked(self):
        """The first launch through tessera.runtime.driver.launch (every check it makes)."""
        self.driver.launch(self.kernel, self.grid, self.block, 0, self.driver.current_torch_stream(), self.args)

    def __call__(self):
        d = self.d
        result = d.cuLaunchKernel(self.kernel.handle, *self.grid, *self.block, 0,
                                  d.CUstream(self.driver.current_torch_stream()), self.packed.address, 0)
        if result[0] != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel({self.kernel.name}): {result[0]}")


def run(args, directory: Path, manifest: dict) -> int:
    import torch
    import triton

    from tessera.bench.timing import median_ms, rel_err
    from tessera.runtime import cache, driver

    def ms(f) -> float:   # bench/cuda_tile.py's settings: do_bench(rep=200), median
        return median_ms(f, warmup=25, rep=200)

    capability = torch.cuda.get_device_capability()
    if tuple(capability) != CAPABILITY:
        print(f"(the prebuilt cuTile cubins are for {manifest['arch']}a; this GPU is sm_{capability[0]}{capability[1]}: "
              f"nothing to run)")
        return 0
    bench = tessera_bench()
    cases = {c[0]: c for c in our_cases(bench)}
    device = torch.cuda.current_device()
    driver.primary_context(device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    tdtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# {describe(manifest)}")
    print(f"# python3 bench/cutile_samples.py {' '.join(sys.argv[1:])}")
    print("| case | dtype | cuTile sample | sample ms | ptx ms | cuda-tile ms | sample TFLOP/s | ptx TFLOP/s | "
          "cuda-tile TFLOP/s | ptx/sample | tile/sample | rel err sample / ptx / tile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    status = 0
    for dtype in args.dtypes.split(","):
        for label in GEMM_LABELS + ATTENTION_LABELS:
            entries = [e for e in manifest["entries"] if e["label"] == label and e["dtype"] == dtype]
            if not entries:
                print(f"| {label} | {dtype} | (not prebuilt) |||||||||")
                continue
            _, fn, shapes, (_, work) = cases[label]
            if any(e["shapes"] != {k: list(v) for k, v in shapes.items()} for e in entries):
                raise SystemExit(f"{label}: bench/cuda_tile.py's shapes {shapes} are not the prebuilt ones: prebuild again")
            gen = torch.Generator(device="cuda").manual_seed(0)
            inputs = [(torch.randn(s, device="cuda", generator=gen) / math.sqrt(s[-1] if len(s) > 1 else 1)).to(tdtypes[dtype])
                      for s in shapes.values()]
            want = bench.torch_reference(torch, fn, inputs)()
            tensors = dict(zip(shapes, inputs))
            tensors["out"] = torch.empty_like(want)
            tol = TOLERANCE[dtype]

            tessera = {}
            for backend in ("ptx", "cuda-tile"):
                try:
                    err = rel_err(fn(*inputs, backend=backend), want)
                    tessera[backend] = (ms(lambda: fn(*inputs, backend=backend)) if err <= tol else None, err)
                    if not err <= tol:
                        print(f"({label} {dtype} Tessera {backend}: WRONG, rel err {err:.1e} > {tol:.0e}: not timed)")
                        status = 1
                except Exception as e:   # e.g. cuda-tile cubins not prebuilt on a machine without tileiras
                    print(f"({label} {dtype} Tessera {backend}: {type(e).__name__}: {str(e).splitlines()[0][:160]})")
                    tessera[backend] = (None, None)

            results = []
            for e in entries:
                kernel = cache.functions.kernel((directory / e["cubin"]).read_bytes(), e["symbol"], device)
                if tuple(tensors["out"].shape) != case_shapes(e)["out"]:
                    raise SystemExit(f"{label}: output {tuple(tensors['out'].shape)}, manifest {case_shapes(e)['out']}")
                arrays = {param: (dtype, tuple(tensors[arg].shape), tuple(tensors[arg].stride()), tensors[arg].data_ptr())
                          for param, arg in case_tensors(e).items()}
                block = (1, 1, 1) if args.block == "one" else tuple(e["block"])
                launch = Launch(kernel, grid_of(e, sm_count), block, launch_args(e["params"], arrays, e["scalars"]))
                tensors["out"].fill_(float("nan"))
                launch.checked()
                err = rel_err(tensors["out"], want)
                t = ms(launch) if err <= tol else None
                results.append((e, t, err))
            want = None

            def show(e, t, err, note=""):
                nonlocal status
                if t is None:
                    status = 1
                ptx_t, ptx_err = tessera["ptx"]
                tile_t, tile_err = tessera["cuda-tile"]

                def cell(x, f):
                    return "n/a" if x is None else f(x)
                rate = lambda x: f"{work / x / 1e9:.0f}"   # noqa: E731
                ratio = (lambda x: f"{t / x:.2f}x") if t is not None else (lambda x: "n/a")
                errs = " / ".join(cell(x, lambda v: f"{v:.1e}") for x in (err, ptx_err, tile_err))
                verdict = "" if t is not None else f" WRONG (> {tol:.0e})"
                print(f"| {label} | {dtype} | {e['kernel']} {e['variant']}{note}{verdict} | {cell(t, lambda x: f'{x:.3f}')} | "
                      f"{cell(ptx_t, lambda x: f'{x:.3f}')} | {cell(tile_t, lambda x: f'{x:.3f}')} | {cell(t, rate)} | "
                      f"{cell(ptx_t, rate)} | {cell(tile_t, rate)} | {cell(ptx_t, ratio)} | {cell(tile_t, ratio)} | "
                      f"{errs} |", flush=True)

            # the sample's default, its fastest variant, any that failed
            timed = [r for r in results if r[1] is not None]
            best = min(timed, key=lambda r: r[1]) if len(results) > 1 and timed else None
            for r in results:
                if r[0]["default"]:
                    show(*r, " (sample default" + (f", best of {len(results)})" if r is best else ")"))
            if best is not None and not best[0]["default"]:
                show(*best, f" (best of {len(results)} configs)")
            for r in results:
                if r[1] is None and not r[0]["default"]:
                    show(*r)
            tensors = inputs = None   # this case's tensors go before the next case's are made
            torch.cuda.empty_cache()
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prebuild", action="store_true",
                        help="compile the samples' kernels (needs cuda-tile, tileiras, torch, the samples; no GPU)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the prebuilt launch plans against the cubins (no GPU)")
    parser.add_argument("--samples", help="NVIDIA/cutile-python checkout, its samples/, or a bare git dir "
                                          "(default $CUTILE_SAMPLES; --prebuild only)")
    parser.add_argument("--dir", help=f"where the cubins and manifest.json go (default $TESSERA_CACHE_DIR/{SUBDIR})")
    parser.add_argument("--dtypes", default="bf16,fp16", help="comma-separated from bf16, fp16 (default both)")
    parser.add_argument("--fmha-configs", default="sample",
                        help="attention tiles to prebuild: 'sample' (the wrapper's default plus the single-CTA "
                             "entries of the sample's autotuning space), 'default', or a list like 64x64o4,128x64o2")
    parser.add_argument("--samples-only", action="store_true",
                        help="--prebuild: skip Tessera's own cuda-tile cubins for these cases")
    parser.add_argument("--block", choices=("reqntid", "one"), default="reqntid",
                        help="block size to launch with: the cubin's REQNTID (default) or cuTile's (1, 1, 1)")
    args = parser.parse_args()
    if args.prebuild:
        return prebuild(args)
    directory = cache_dir(args.dir)
    manifest = load_manifest(directory)
    if manifest is None:
        print(f"(no prebuilt cuTile sample cubins in {directory}: on a machine with tileiras run "
              f"`TESSERA_CACHE_DIR=... python3 bench/cutile_samples.py --prebuild --samples PATH`, then carry "
              f"the directory here)")
        return 0
    return dry_run(directory, manifest) if args.dry_run else run(args, directory, manifest)


if __name__ == "__main__":
    sys.exit(main())
