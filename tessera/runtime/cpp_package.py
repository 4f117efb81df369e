"""C/C++ host code for an AOT package: `tessera package` writes, beside manifest.json,

    tessera_package_runtime.h/.cpp   the shared launcher over the CUDA driver API (fixed text)
    tessera_<func>.h / .cpp          per function: its C entry point(s) and its launch tables, with
                                     the cubins and PTX embedded as byte arrays
    example_<func>.cpp               runs the function on the package's reference inputs and checks
                                     its outputs against the reference outputs (reference/)
    CMakeLists.txt                   library `tessera_package` (CUDA::cuda_driver) and the examples

The tables are the artifact records' own launch data (runtime/artifact.py: grid, threads, dynamic
shared memory, pointer params, tensor maps, steps, intermediates); the tensor-map layout comes
from driver._tensor_map_layout. Image choice in C follows `Artifact.image_for` (docs/PACKAGES.md).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from .. import dtypes
from . import driver, tensor_maps
from .artifact import Artifact

RUNTIME_H = "tessera_package_runtime.h"
RUNTIME_CPP = "tessera_package_runtime.cpp"
REFERENCE_DIR = "reference"


def groups(artifacts: Sequence[Artifact]) -> dict[str, dict[tuple, list[Artifact]]]:
    """function name -> (shapes and dtypes of its arguments, a dynamic dim by its name) -> its
    specializations (one per arch)."""
    out: dict[str, dict[tuple, list[Artifact]]] = {}
    for a in artifacts:
        key = tuple((tuple(x["shape"]), x["dtype"]) for x in a.record["arguments"])
        out.setdefault(a.name, {}).setdefault(key, []).append(a)
    return out


def entry_names(name: str, by_shape: Mapping[tuple, list[Artifact]]) -> dict[tuple, str]:
    """The C function per shape group: `tessera_<name>`, suffixed by the dims when there are several."""
    if len(by_shape) == 1:
        return {key: f"tessera_{name}" for key in by_shape}
    return {key: f"tessera_{name}_" + "_".join(d if v == "dynamic" else f"{d}{v}"
                                               for d, v in arts[0].record["dims"].items())
            for key, arts in by_shape.items()}


def dynamic_dims(a: Artifact) -> list[str]:
    """The dims a shape-generic specialization takes from its caller (as `int64_t` params, in this order)."""
    return [d for d, v in a.record["dims"].items() if v == "dynamic"]


def c_params(a: Artifact) -> list[str]:
    """The entry point's buffer params: the arguments, then (for a `function`) its results."""
    names = list(a.arg_names)
    if a.record["kind"] == "function":
        names += [r for r in a.result_names]
    return names


def _nbytes(buffer: Mapping) -> int:
    """A buffer's bytes; of one with a dynamic dim, its bytes per unit of that dim."""
    static = [n for n in buffer["shape"] if not isinstance(n, str)]
    return int(np.prod(static, dtype=np.int64)) * dtypes.lookup(buffer["dtype"]).itemsize


def _buffer_dim(buffer: Mapping, names: Sequence[str]) -> int:
    """The index in `names` of a buffer's dynamic dim (it has one at most), or -1."""
    return next((names.index(n) for n in buffer["shape"] if isinstance(n, str)), -1)


def _map_layout(spec: Mapping, itemsize: int) -> tuple[list[int], list[int], list[int], int]:
    """A tensor map's dims, byte strides and box as the C runtime's table holds them (innermost
    first, `driver._tensor_map_layout`), a dynamic dim's size 0, and the bit mask of the strides
    that the run multiplies by that dim's size (the dims outside it)."""
    shape = list(spec["shape"])
    if tensor_maps.DYNAMIC not in shape:
        return (*driver._tensor_map_layout(SimpleNamespace(**spec), itemsize), 0)
    dynamic = shape.index(tensor_maps.DYNAMIC)
    unit = {**spec, "shape": [1 if n == tensor_maps.DYNAMIC else n for n in shape]}
    dims, strides, box = driver._tensor_map_layout(SimpleNamespace(**unit), itemsize)
    dims = [0 if n == tensor_maps.DYNAMIC else n for n in reversed(shape)]
    # the dims outside the dynamic one (outermost-first d < dynamic) are innermost-first rank-1-d,
    # whose strides sit at index rank-2-d (the innermost dim has none)
    scaled = sum(1 << (len(shape) - 2 - d) for d in range(dynamic))
    return dims, strides, box, scaled


def _bytes_literal(data: bytes) -> str:
    hexes = [f"0x{b:02x}" for b in data]
    return ",\n".join(",".join(hexes[i:i + 24]) for i in range(0, len(hexes), 24))


def _ints(values) -> str:
    return "{" + ", ".join(str(int(v)) for v in values) + "}"


# --- per function ------------------------------------------------------------------------------

def function_sources(name: str, by_shape: Mapping[tuple, list[Artifact]], files: Mapping[str, bytes]) -> tuple[str, str]:
    """(header, source) of one function."""
    entries = entry_names(name, by_shape)
    decls, defs, blobs = [], [], {}
    for key, arts in by_shape.items():
        entry = entries[key]
        first = arts[0]
        params = c_params(first)
        names = dynamic_dims(first)
        shapes = {x["name"]: (x["shape"], x["dtype"]) for x in first.record["arguments"]}
        shapes.update({r["name"]: (r["shape"], r["dtype"]) for r in first.record["results"]} if first.record["kind"] == "function" else {})
        doc = "\n".join(f" *   {p}: {shapes[p][1]}[{', '.join(map(str, shapes[p][0]))}]" for p in params)
        writes = ", ".join(first.result_names)
        fixed = (f"Pass dense row-major device buffers, 16-byte aligned, of these shapes ({', '.join(names)}: "
                 f"any value from 2 up to 2^31 - 2^16, passed after the buffers):" if names else
                 "Shapes are fixed: pass dense row-major device buffers, 16-byte aligned, of exactly these shapes:")
        signature = ", ".join([*(f"CUdeviceptr {p}" for p in params), *(f"int64_t {d}" for d in names)])
        decls.append(f"""/* {entry}: {first.record['kind']} {name} for dims {json.dumps(first.record['dims'])}.
 * {fixed}
{doc}
 * Writes {writes}. Launches on `stream` in the current CUDA context (make one current first, e.g.
 * cuDevicePrimaryCtxRetain + cuCtxSetCurrent). Returns 0 on success; otherwise a TESSERA_ERROR_*
 * code with a NUL-terminated message in error[0..error_len) (when error is not NULL), and nothing
 * is launched for bad input. Compiled for: {", ".join(a.record['arch'] for a in arts)}. */
int {entry}({signature}, CUstream stream, char* error, size_t error_len);
""")
        specs = []
        for s, a in enumerate(arts):
            r = a.record
            tag = f"{entry}_{s}"
            kernel_rows, step_rows = [], []
            kernel_index = {k: i for i, k in enumerate(r["kernels"])}
            for i, (kname, k) in enumerate(r["kernels"].items()):
                launch = k["launch"]
                image_rows = []
                for arch, ref in k["images"].items():
                    blob = ref["file"]
                    if blob not in blobs:
                        blobs[blob] = f"image_{len(blobs)}"
                    kind = 1 if arch == "ptx" else 0
                    size = ref["size"] + kind   # PTX carries its NUL
                    image_rows.append(f'{{"{r["arch"] if kind else arch}", {kind}, {blobs[blob]}, {size}}}')
                maps = []
                for m in launch["tensor_maps"]:
                    dtype = dtypes.lookup(m["dtype"])
                    dims, strides, box, scaled = _map_layout(m, dtype.itemsize)
                    maps.append(f"{{{m['arg']}, CU_TENSOR_MAP_DATA_TYPE_{driver._TENSOR_MAP_DTYPES[dtype]}, "
                                f"{len(dims)}, {_ints(dims)}, {_ints(strides or [0])}, {_ints(box)}, "
                                f"CU_TENSOR_MAP_SWIZZLE_{driver._TENSOR_MAP_SWIZZLES[m['swizzle']]}, {scaled}}}")
                specs_maps = f"{tag}_k{i}_maps"
                defs.append(f"static const tessera_rt::Image {tag}_k{i}_images[] = {{{', '.join(image_rows)}}};")
                if maps:
                    defs.append(f"static const tessera_rt::TensorMap {specs_maps}[] = {{{', '.join(maps)}}};")
                grid = launch["grid"]
                terms, sizes_of = launch.get("grid_terms", []), launch.get("dims", [])
                if terms:
                    defs.append(f"static const int {tag}_k{i}_grid_terms[] = {_ints(x for t in terms for x in t)};")
                if sizes_of:
                    defs.append(f"static const int {tag}_k{i}_dim_params[] = {_ints(x for d in sizes_of for x in d)};")
                kernel_rows.append(f'{{"{launch["name"]}", {_ints(grid)}, {launch["threads"]}, {launch["dynamic_shared"]}, '
                                   f'{launch["pointers"]}, {specs_maps if maps else "nullptr"}, {len(maps)}, '
                                   f'{tag}_k{i}_images, {len(image_rows)}, '
                                   f'{f"{tag}_k{i}_grid_terms" if terms else "nullptr"}, {len(terms)}, '
                                   f'{f"{tag}_k{i}_dim_params" if sizes_of else "nullptr"}, {len(sizes_of)}}}')
            for j, step in enumerate(r["steps"]):
                defs.append(f"static const int {tag}_s{j}_buffers[] = {_ints(step['buffers'] or [0])};")
                step_rows.append(f"{{{kernel_index[step['kernel']]}, {tag}_s{j}_buffers, {len(step['buffers'])}}}")
            n_args, n_res = len(r["arguments"]), len(r["results"])
            buffers = [*r["arguments"], *r["results"], *r["intermediates"]]
            sizes = [_nbytes(b) for b in buffers]
            if r.get("index_bits", 64) != 64 or any(m > 1 for m in r.get("dim_multiples", {}).values()):
                raise ValueError(f"{entry}: the C entry points take any size; its kernels must use 64-bit offsets "
                                 f"and take every value of a dynamic dim")
            defs.append(f"static const int {tag}_buffer_dim[] = {_ints(_buffer_dim(b, names) for b in buffers)};")
            # where each result lives: the caller's param (function: its own; kernel: the argument it names)
            result_param = ([n_args + i for i in range(n_res)] if r["kind"] == "function"
                            else [a.arg_names.index(n) for n in a.result_names])
            defs.append(f"static const tessera_rt::Kernel {tag}_kernels[] = {{{', '.join(kernel_rows)}}};")
            defs.append(f"static const tessera_rt::Step {tag}_steps[] = {{{', '.join(step_rows)}}};")
            defs.append(f"static const size_t {tag}_sizes[] = {_ints(sizes)};")
            defs.append(f"static const int {tag}_result_param[] = {_ints(result_param or [0])};")
            specs.append(f'{{"{r["arch"]}", {n_args}, {n_res}, {len(r["intermediates"])}, {tag}_sizes, '
                         f'{tag}_buffer_dim, {tag}_result_param, {"true" if r["reads_outputs"] else "false"}, '
                         f'{tag}_kernels, {len(kernel_rows)}, {tag}_steps, {len(step_rows)}}}')
        defs.append(f"static const tessera_rt::Spec {entry}_specs[] = {{{', '.join(specs)}}};")
        quoted = ", ".join(f'"{d}"' for d in names) or "nullptr"
        defs.append(f"static const char* const {entry}_dim_names[] = {{{quoted}}};")
        defs.append(f"static tessera_rt::Function {entry}_function = {{\"{entry}\", {entry}_specs, {len(specs)}, "
                    f"{len(params)}, {len(names)}, {entry}_dim_names}};")
        args = ", ".join(params)
        defs.append(f"""}}  // namespace

extern "C" int {entry}({signature}, CUstream stream, char* error, size_t error_len) {{
  const CUdeviceptr tessera_params_[] = {{{args}}};
  const char* tessera_names_[] = {{{", ".join(f'"{p}"' for p in params)}}};
  const int64_t tessera_dims_[] = {{{", ".join(names) or "0"}}};
  return tessera_rt::run({entry}_function, tessera_params_, tessera_names_, tessera_dims_, stream, error, error_len);
}}

namespace {{""")
    guard = f"TESSERA_{name.upper()}_H"
    header = f"""/* Generated by `tessera package`: the C API of {name}. Do not edit. */
#ifndef {guard}
#define {guard}
#include <stddef.h>
#include <cuda.h>
#include "{RUNTIME_H}"
#ifdef __cplusplus
extern "C" {{
#endif

{chr(10).join(decls)}
#ifdef __cplusplus
}}
#endif
#endif
"""
    blob_defs = []
    for file, var in blobs.items():
        data = files[file] + (b"\0" if file.endswith(".ptx") else b"")
        blob_defs.append(f"alignas(64) static const unsigned char {var}[] = {{\n{_bytes_literal(data)}}};  // {file}")
    source = f"""// Generated by `tessera package`: {name}'s launches and images. Do not edit.
#include "tessera_{name}.h"
#include "tessera_package_runtime_internal.h"

namespace {{
{chr(10).join(blob_defs)}

{chr(10).join(defs)}
}}  // namespace
"""
    return header, source


# --- the example -----------------------------------------------------------------------------

_C_TYPES = {"fp32": "float", "int32": "int32_t"}


def example_source(name: str, by_shape: Mapping[tuple, list[Artifact]], references: Mapping[str, dict]) -> str:
    entries = entry_names(name, by_shape)
    blocks = []
    for key, arts in by_shape.items():
        entry = entries[key]
        a = arts[0]
        ref = references[entry]
        params = c_params(a)
        names = dynamic_dims(a)
        shapes = {x["name"]: x["shape"] for x in [*ref["inputs"].values(), *ref["outputs"]]}
        bufs = {x["name"]: {**x, "shape": shapes[x["name"]]} for x in a.record["arguments"]}
        if a.record["kind"] == "function":
            bufs.update({x["name"]: {**x, "shape": shapes[x["name"]]} for x in a.record["results"]})
        # the dynamic dims' values in the reference run: an argument's dim where it is dynamic
        values = {n: shapes[x["name"]][axis] for x in a.record["arguments"]
                  for axis, n in enumerate(x["shape"]) if isinstance(n, str)}
        dims = "".join(f", (int64_t){values[d]}" for d in names)
        lines = [f"  {{  // {entry}", f"    std::printf(\"{entry}:\\n\");"]
        for p in params:
            lines.append(f"    CUdeviceptr d_{p} = 0; size_t n_{p} = {_nbytes(bufs[p])};")
            lines.append(f"    CHECK(cuMemAlloc(&d_{p}, n_{p}));")
            inp = ref["inputs"].get(p)
            if inp is not None:
                lines.append(f"    {{ std::vector<unsigned char> h = read_file(dir + \"/{inp['file']}\", n_{p}); "
                             f"CHECK(cuMemcpyHtoD(d_{p}, h.data(), n_{p})); }}")
            else:
                lines.append(f"    CHECK(cuMemsetD8(d_{p}, 0xff, n_{p}));  // NaN-ish poison: unwritten outputs fail")
        call = ", ".join(f"d_{p}" for p in params) + dims
        lines.append(f"    int rc = {entry}({call}, stream, error, sizeof error);")
        lines.append(f"    if (rc != 0) {{ std::fprintf(stderr, \"{entry} failed (%d): %s\\n\", rc, error); return 1; }}")
        lines.append("    CHECK(cuStreamSynchronize(stream));")
        for out in ref["outputs"]:
            p, dt = out["name"], out["dtype"]
            lines.append(f"    {{ std::vector<unsigned char> got(n_{p}); CHECK(cuMemcpyDtoH(got.data(), d_{p}, n_{p}));")
            lines.append(f"      std::vector<unsigned char> want = read_file(dir + \"/{out['file']}\", n_{p});")
            lines.append(f"      if (!compare(\"{p}\", \"{dt}\", got, want, {out['tolerance']!r})) failed = true; }}")
        # the API refuses a misaligned pointer without launching
        p0 = params[0]
        misaligned = ", ".join(f"d_{p} + 8" if p == p0 else f"d_{p}" for p in params) + dims
        lines.append(f"    rc = {entry}({misaligned}, stream, error, sizeof error);")
        lines.append("    if (rc != TESSERA_ERROR_INVALID_ARGUMENT) { std::fprintf(stderr, \"a misaligned pointer "
                     "was not refused (%d)\\n\", rc); failed = true; }")
        lines.append(f"    else std::printf(\"  misaligned {p0} refused: %s\\n\", error);")
        if names:   # a dynamic dim of 1 (which broadcasts: not this specialization's) is refused too
            one = ", ".join(f"d_{p}" for p in params) + "".join(
                ", (int64_t)1" if i == 0 else f", (int64_t){values[d]}" for i, d in enumerate(names))
            lines.append(f"    rc = {entry}({one}, stream, error, sizeof error);")
            lines.append("    if (rc != TESSERA_ERROR_INVALID_ARGUMENT) { std::fprintf(stderr, \"a dynamic dim of 1 "
                         "was not refused (%d)\\n\", rc); failed = true; }")
            lines.append(f"    else std::printf(\"  {names[0]}=1 refused: %s\\n\", error);")
        for p in params:
            lines.append(f"    cuMemFree(d_{p});")
        lines.append("  }")
        blocks.append("\n".join(lines))
    return f"""// Generated by `tessera package`: runs {name} on the package's reference inputs (fixed-seed random
// values the CPU interpreter ran on) and checks each output against the interpreter's, by relative
// L2 error within the tolerance of reference/{name}.json. Usage: example_{name} [PACKAGE_DIR]
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>
#include "tessera_{name}.h"

#define CHECK(call) do {{ CUresult r_ = (call); if (r_ != CUDA_SUCCESS) {{ const char* s_ = nullptr; \\
  cuGetErrorString(r_, &s_); std::fprintf(stderr, "%s failed: %s\\n", #call, s_ ? s_ : "?"); return 2; }} }} while (0)

#ifndef TESSERA_PACKAGE_DIR
#define TESSERA_PACKAGE_DIR "."
#endif

static std::vector<unsigned char> read_file(const std::string& path, size_t size) {{
  std::ifstream f(path, std::ios::binary);
  std::vector<unsigned char> data(size);
  if (!f.read(reinterpret_cast<char*>(data.data()), (std::streamsize)size)) {{
    std::fprintf(stderr, "cannot read %zu bytes from %s\\n", size, path.c_str());
    std::exit(2);
  }}
  return data;
}}

static double to_double(const char* dtype, const unsigned char* p) {{
  if (!std::strcmp(dtype, "fp32")) {{ float v; std::memcpy(&v, p, 4); return v; }}
  if (!std::strcmp(dtype, "int32")) {{ int32_t v; std::memcpy(&v, p, 4); return v; }}
  if (!std::strcmp(dtype, "bool")) return p[0] ? 1.0 : 0.0;
  if (!std::strncmp(dtype, "fp8_", 4)) {{  // e4m3 (fn: no infinities) or e5m2
    bool e4m3 = !std::strcmp(dtype, "fp8_e4m3");
    int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, sign = p[0] >> 7;
    int exp = (p[0] & 0x7f) >> mbits, man = p[0] & ((1 << mbits) - 1);
    if (e4m3 ? (p[0] & 0x7f) == 0x7f : exp == 31) return NAN;
    double v = exp == 0 ? std::ldexp(man, 1 - bias - mbits) : std::ldexp(man + (1 << mbits), exp - bias - mbits);
    return sign ? -v : v;
  }}
  uint16_t h; std::memcpy(&h, p, 2);
  if (!std::strcmp(dtype, "bf16")) {{ uint32_t u = (uint32_t)h << 16; float v; std::memcpy(&v, &u, 4); return v; }}
  // fp16
  int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
  double v = exp == 0 ? std::ldexp(man, -24) : exp == 31 ? (man ? NAN : INFINITY) : std::ldexp(man + 1024, exp - 25);
  return sign ? -v : v;
}}

static size_t item_size(const char* dtype) {{
  if (!std::strcmp(dtype, "fp32") || !std::strcmp(dtype, "int32")) return 4;
  if (!std::strcmp(dtype, "bool") || !std::strncmp(dtype, "fp8_", 4)) return 1;
  return 2;
}}

static bool compare(const char* name, const char* dtype, const std::vector<unsigned char>& got,
                    const std::vector<unsigned char>& want, double tolerance) {{
  size_t n = got.size() / item_size(dtype), k = item_size(dtype);
  double diff = 0, norm = 0, max_abs = 0;
  for (size_t i = 0; i < n; ++i) {{
    double g = to_double(dtype, &got[i * k]), w = to_double(dtype, &want[i * k]);
    diff += (g - w) * (g - w); norm += w * w;
    if (!(std::fabs(g - w) <= max_abs)) max_abs = std::fabs(g - w);
  }}
  double rel = norm > 0 ? std::sqrt(diff) / std::sqrt(norm) : (diff > 0 ? INFINITY : 0.0);
  bool ok = rel <= tolerance;
  std::printf("  %s: max abs error %.2e, relative error %.2e (tolerance %.1e): %s\\n", name, max_abs, rel,
              tolerance, ok ? "PASS" : "FAIL");
  return ok;
}}

int main(int argc, char** argv) {{
  std::string dir = argc > 1 ? argv[1] : TESSERA_PACKAGE_DIR;
  CHECK(cuInit(0));
  CUdevice device; CHECK(cuDeviceGet(&device, 0));
  CUcontext context; CHECK(cuDevicePrimaryCtxRetain(&context, device));
  CHECK(cuCtxSetCurrent(context));
  CUstream stream; CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  char error[512];
  bool failed = false;
{chr(10).join(blocks)}
  cuStreamDestroy(stream);
  cuDevicePrimaryCtxRelease(device);
  std::printf(failed ? "FAILED\\n" : "all outputs match the reference\\n");
  return failed ? 1 : 0;
}}
"""


def cmake_source(names: Sequence[str]) -> str:
    sources = " ".join(f"tessera_{n}.cpp" for n in names)
    examples = "\n".join(f"add_executable(example_{n} example_{n}.cpp)\n"
                         f"target_link_libraries(example_{n} PRIVATE tessera_package CUDA::cuda_driver)\n"
                         f"target_compile_definitions(example_{n} PRIVATE "
                         f"TESSERA_PACKAGE_DIR=\"${{CMAKE_CURRENT_SOURCE_DIR}}\")" for n in names)
    return f"""# Generated by `tessera package`: the package's C API as a library, and one example per function.
#   cmake -S <package> -B build && cmake --build build && ./build/example_<func>
cmake_minimum_required(VERSION 3.18)
project(tessera_package LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
if(NOT CMAKE_BUILD_TYPE)
  set(CMAKE_BUILD_TYPE Release)
endif()
find_package(CUDAToolkit REQUIRED)
add_library(tessera_package {RUNTIME_CPP} {sources})
target_include_directories(tessera_package PUBLIC ${{CMAKE_CURRENT_SOURCE_DIR}})
target_link_libraries(tessera_package PUBLIC CUDA::cuda_driver)
set_target_properties(tessera_package PROPERTIES POSITION_INDEPENDENT_CODE ON)
{examples}
"""


# --- references ----------------------------------------------------------------------------------

def write_references(directory: Path, entry: str, a: Artifact, inputs: Sequence[np.ndarray],
                     outputs: Sequence[np.ndarray], tolerances: Sequence[float], seed: int) -> dict:
    """Raw little-endian files of one shape group's reference inputs and outputs, and their index."""
    ref_dir = directory / REFERENCE_DIR
    ref_dir.mkdir(exist_ok=True)

    def put(kind: str, name: str, array: np.ndarray, dtype: str) -> dict:
        file = f"{REFERENCE_DIR}/{entry}.{kind}.{name}.bin"
        storage = dtypes.lookup(dtype).np.newbyteorder("<") if dtypes.lookup(dtype).np.itemsize > 1 else dtypes.lookup(dtype).np
        (directory / file).write_bytes(np.ascontiguousarray(array, dtype=storage).tobytes())
        return {"name": name, "file": file, "shape": list(array.shape), "dtype": dtype}

    return {"seed": seed,
            "inputs": {x["name"]: put("in", x["name"], v, x["dtype"]) for x, v in zip(a.record["arguments"], inputs)},
            "outputs": [{**put("out", r["name"], v, r["dtype"]), "tolerance": float(t)}
                        for r, v, t in zip(a.record["results"], outputs, tolerances)]}


# --- writing -----------------------------------------------------------------------------------

def write(directory: str | Path, artifacts: Sequence[Artifact], references: Mapping[str, Mapping[tuple, tuple]],
          seed: int = 0) -> list[Path]:
    """Writes the C/C++ sources, CMakeLists.txt and reference data into the package `directory`.
    `references`: function name -> argument key (as `groups`) -> (inputs, outputs, tolerances)."""
    directory = Path(directory)
    files = {n: d for a in artifacts for n, d in a.files.items()}
    written = []

    def put(name: str, text: str) -> None:
        (directory / name).write_text(text)
        written.append(directory / name)

    here = Path(__file__).parent / "cpp"
    for fixed in (RUNTIME_H, RUNTIME_CPP, "tessera_package_runtime_internal.h"):
        put(fixed, (here / fixed).read_text())
    by_function = groups(artifacts)
    for name, by_shape in by_function.items():
        header, source = function_sources(name, by_shape, files)
        put(f"tessera_{name}.h", header)
        put(f"tessera_{name}.cpp", source)
        entries = entry_names(name, by_shape)
        refs = {entries[key]: write_references(directory, entries[key], arts[0], *references[name][key], seed)
                for key, arts in by_shape.items()}
        put(f"{REFERENCE_DIR}/{name}.json", json.dumps(refs, indent=1))
        put(f"example_{name}.cpp", example_source(name, by_shape, refs))
    put("CMakeLists.txt", cmake_source(list(by_function)))
    return written
