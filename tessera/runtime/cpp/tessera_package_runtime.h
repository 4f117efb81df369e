/* Tessera AOT package runtime: error codes of the generated C entry points. */
#ifndef TESSERA_PACKAGE_RUNTIME_H
#define TESSERA_PACKAGE_RUNTIME_H
#define TESSERA_OK 0
#define TESSERA_ERROR_INVALID_ARGUMENT 1  /* a NULL or misaligned pointer: nothing launched */
#define TESSERA_ERROR_NO_IMAGE 2          /* no cubin or PTX of the package runs on this GPU */
#define TESSERA_ERROR_CUDA 3              /* a driver call failed (message names it) */
#endif
