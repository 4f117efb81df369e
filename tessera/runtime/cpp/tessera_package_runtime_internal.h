// Tessera AOT package runtime: the tables the generated sources fill, and the launcher.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cuda.h>
#include "tessera_package_runtime.h"

namespace tessera_rt {

struct Image { const char* arch; int is_ptx; const unsigned char* data; size_t size; };  // PTX: arch = its target
struct TensorMap {  // dims innermost first; a dynamic dim is 0 (the run's size), and the byte
  // strides of the dims outside it (bit k of `scaled`: strides[k]) are multiples of that size
  int arg; CUtensorMapDataType dtype; unsigned rank;
  cuuint64_t dims[5]; cuuint64_t strides[4]; cuuint32_t box[5]; CUtensorMapSwizzle swizzle; unsigned scaled;
};
struct Kernel {
  const char* name; unsigned grid[3]; unsigned threads; unsigned dynamic_shared; int pointers;
  const TensorMap* maps; int n_maps; const Image* images; int n_images;
  // shape-generic: grid axes that grow with a dynamic dim, (axis, param, dim, block) each multiplying
  // grid[axis] by cdiv(that param's buffer's size along dim, block); and the u32 size params the
  // kernel takes after its maps, (param, dim) each
  const int* grid_terms; int n_grid_terms; const int* dim_params; int n_dim_params;
};
struct Step { int kernel; const int* buffers; int n_buffers; };
struct Spec {
  const char* arch; int n_args, n_results, n_intermediates;
  const size_t* sizes;        // bytes per buffer: arguments, results, intermediates (per unit of its dim)
  const int* buffer_dim;      // per buffer: the Function's dynamic dim it has (one at most), or -1
  const int* result_param;    // per result: the caller's param it lives in
  bool reads_outputs;
  const Kernel* kernels; int n_kernels; const Step* steps; int n_steps;
};
struct Function {
  const char* name; const Spec* specs; int n_specs; int n_params;
  int n_dims; const char* const* dim_names;  // the dims the caller passes (shape-generic specializations)
};

int run(Function& f, const CUdeviceptr* params, const char* const* names, const int64_t* dims, CUstream stream,
        char* error, size_t error_len);

}  // namespace tessera_rt
