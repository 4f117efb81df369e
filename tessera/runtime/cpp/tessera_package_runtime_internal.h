// Tessera AOT package runtime: the tables the generated sources fill, and the launcher.
#pragma once
#include <cstddef>
#include <cuda.h>
#include "tessera_package_runtime.h"

namespace tessera_rt {

struct Image { const char* arch; int is_ptx; const unsigned char* data; size_t size; };  // PTX: arch = its target
struct TensorMap {
  int arg; CUtensorMapDataType dtype; unsigned rank;
  cuuint64_t dims[5]; cuuint64_t strides[4]; cuuint32_t box[5]; CUtensorMapSwizzle swizzle;
};
struct Kernel {
  const char* name; unsigned grid[3]; unsigned threads; unsigned dynamic_shared; int pointers;
  const TensorMap* maps; int n_maps; const Image* images; int n_images;
};
struct Step { int kernel; const int* buffers; int n_buffers; };
struct Spec {
  const char* arch; int n_args, n_results, n_intermediates;
  const size_t* sizes;        // bytes per buffer: arguments, results, intermediates
  const int* result_param;    // per result: the caller's param it lives in
  bool reads_outputs;
  const Kernel* kernels; int n_kernels; const Step* steps; int n_steps;
};
struct Function { const char* name; const Spec* specs; int n_specs; int n_params; };

int run(Function& f, const CUdeviceptr* params, const char* const* names, CUstream stream, char* error,
        size_t error_len);

}  // namespace tessera_rt
