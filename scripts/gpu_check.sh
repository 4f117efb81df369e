#!/usr/bin/env bash
# The one script run on the GPU machine: what is installed there, then the GPU
# tests, then the benchmarks. Run it from anywhere in a checkout:
#     bash scripts/gpu_check.sh
# Tessera is not pip-installed there; it runs from the checkout on PYTHONPATH.
# Pure-Python dependencies that machine lacks (xdsl, ...) travel as wheels in
# .whl/ and are unpacked into /tmp/site.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

section() { printf '\n===== %s =====\n' "$1"; }

# Runs a Python one-liner; prints `fallback` instead when it fails.
py() { python3 -c "$1" 2>/dev/null || echo "$2"; }

section "GPU"
nvidia-smi || echo "nvidia-smi failed"

section "Bundled wheels (.whl/)"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
    ls .whl
else
    echo "none"
fi

section "Versions"
python3 --version
py "import torch; print('torch', torch.__version__, '(CUDA', torch.version.cuda, ')', 'cuda available:', torch.cuda.is_available())" "torch: not installed"
py "import cuda.bindings; print('cuda-bindings', cuda.bindings.__version__)" \
    "$(py "from tessera.runtime import driver; print(driver.bindings_version())" "cuda-bindings: not installed")"
py "import cupy; print('cupy', cupy.__version__)" "cupy: not installed"
py "import triton; print('triton', triton.__version__)" "triton: not installed"
py "import numpy, ml_dtypes, xdsl; print('numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__, 'xdsl', xdsl.__version__)" \
    "numpy/ml_dtypes/xdsl: not all importable"
ptxas --version 2>/dev/null | grep -i release || echo "ptxas: not on PATH"
cuobjdump --version 2>/dev/null | grep -i release || echo "cuobjdump: not on PATH"
py "from tessera.runtime import driver; d = driver.Device(0); print(d, '->', d.platform().arch, '| SMs', d.sm_count, '| smem/block', d.max_shared_per_block_optin, '| L2', d.l2_bytes)" \
    "tessera.runtime could not open device 0"

section "GPU tests"
# addopts is cleared so that -q is said once (twice hides the pass/fail counts).
python3 -m pytest -q -o addopts= tests/gpu -rs || status=1

section "Benchmarks"
# Tessera and its peers, 7 rounds per case; the JSON (device, driver, versions, commit, per-case median,
# MAD, IQR) goes to $OUT/bench.json when $OUT is set, else bench/results/bench.json. Against the
# device's baseline where the repository keeps one (exit 1 on a regression beyond the measured noise).
bench_json="${OUT:-bench/results}/bench.json"
baseline=$(python3 -c "from tessera.bench.results import baseline_path; from tessera.bench.environment import gpu; print(baseline_path(gpu()[0] or 'unknown'))" 2>/dev/null)
if [[ -n "$baseline" && -f "$baseline" ]]; then
    python3 -m tessera bench --json "$bench_json" --compare "$baseline" || status=1
else
    echo "(no baseline ${baseline:-for this device}; record one with: python3 -m tessera bench --write-baseline)"
    python3 -m tessera bench --json "$bench_json" || status=1
fi

# Per kernel: time, TFLOP/s, GB/s, fraction of the roofline, occupancy (and ncu's metrics where ncu is on PATH).
section "Profile"
# (The run checks against a float64 NumPy reference, so the shape stays where that takes seconds.)
plot=()
python3 -c "import matplotlib" 2>/dev/null && mkdir -p "${OUT:-bench/results}" && plot=(--plot "${OUT:-bench/results}/roofline.png")
python3 -m tessera profile examples/flash_attention.py:causal_flash_attention --shape B=2,H=16,S=2048,D=128 "${plot[@]}" \
    || status=1

# What the mma.sync path can reach here (instruction ceiling, clocks and power at the card's limit)
# and what persistent GEMM tiles change, on both paths.
section "mma.sync ceiling"
python3 bench/mma_sync_ceiling.py || status=1
section "Persistent GEMM"
python3 bench/persistent_gemm.py || status=1
# GEMMs whose B rows split 128-byte lines: blocks in clusters of two sharing B's tiles, and 128 x 192 tiles.
section "GEMM clusters"
python3 bench/gemm_clusters.py || status=1
# The GEMMs' fixed cost (epilogue, pipeline fill, last wave) against their main loop, from a K sweep.
section "GEMM fixed cost"
python3 bench/gemm_fixed_cost.py || status=1
# GEMMs with too few output tiles for the GPU: the split_k the compiler derives against none and the best.
section "Split-K GEMM"
python3 bench/split_k_gemm.py || status=1
# Decode attention (one query against a long KV cache): the split-KV kernels against cuDNN and FlashAttention.
section "Decode attention"
python3 bench/decode_attention.py || status=1

# Variable-length attention (packed sequences, FlashAttention's cumulative lengths) against torch's varlen kernel,
# FlexAttention's document mask and cuDNN on the padded batch; a packed decode step against the paged form.
section "Varlen attention"
python3 bench/varlen_attention.py || status=1

# FP8 GEMMs (scales as tensor math, wgmma m64nNk32) against torch._scaled_mm (cuBLASLt) and Tessera's bf16 GEMM.
section "FP8 GEMM"
python3 bench/fp8_gemm.py || status=1
# FP8 attention (e4m3 Q, K, V with scales; P @ V on fp8 tensor cores) against Tessera's bf16 attention and cuDNN,
# with each one's error against float64.
section "FP8 attention"
python3 bench/fp8_attention.py || status=1
# ... and causal fp8 attention compiled for each shape alone (the script above compiles its later shapes
# shape-generic), a process a shape.
for shape in 8x16x4096x128 32x12x2048x128 4x16x8192x128 16x16x2048x64; do
    python3 bench/fp8_attention_specialized.py "$shape" || status=1
done

# Transcendental epilogues (GEMM + gelu/silu) against torch, and soft-capped attention against FlexAttention.
section "Activations"
python3 bench/activations.py || status=1

# Attention over few heads (grids of a few waves): the derived schedule (last query blocks first, 64-row blocks)
# against cuDNN, FlashAttention-2 and FlexAttention.
section "Attention over few heads"
python3 bench/attention_small_grids.py || status=1

# Strided inputs ([B, S, H, D] views, slices of wider matrices, a prefix of a KV cache) read in place, against the
# same kernels on contiguous tensors, copying first, and torch on the same views.
section "Strided inputs"
python3 bench/strided_inputs.py || status=1

# Attention backward (flash_chain kernels, no S x S tensor) against SDPA's FlashAttention-2 and cuDNN, and FlexAttention.
section "Attention backward"
python3 bench/attention_backward.py || status=1

# Norm backwards (the dx kernel carrying the weight's and bias's column sums) against torch's and the copy bandwidth,
# and the row kernels forward (softmax, layer_norm, rms_norm) at issue 15's shapes.
section "Norm backward"
python3 bench/norm_backward.py || status=1
section "Row kernels"
python3 bench/row_kernels.py || status=1

# Shape-generic kernels (a row count taken at run time) against the kernels compiled for each count and torch,
# the host time per call, and the compiles a sweep of random counts costs.
section "Shape-generic kernels"
python3 bench/dynamic_shapes.py || status=1

# Host time per call of a cached function or kernel (the C fast path) against torch's eager ops and a Triton launch.
section "Launch overhead"
python3 bench/launch_overhead.py || status=1

# A Llama-style block over every visible GPU (tensor and sequence parallelism) against torch's DTensor.
section "Tensor parallelism"
python3 bench/tensor_parallel.py || status=1

# The CUDA Tile IR backend against the PTX backend. Where tileiras is not installed its cubins come from
# the cubin cache (TESSERA_CACHE_DIR), filled on a machine with tileiras by `python3 bench/cuda_tile.py --prebuild`.
section "CUDA Tile IR backend"
if python3 -c "from tessera.backends.cuda_tile import tools; import sys; sys.exit(not tools.available())" 2>/dev/null \
        || [[ -n "${TESSERA_CACHE_DIR:-}" ]]; then
    python3 bench/cuda_tile.py --dtypes bf16,fp16 || status=1
else
    echo "(no tileiras and no TESSERA_CACHE_DIR of prebuilt cubins: pip install 'tessera[cuda-tile]')"
fi

exit "$status"
