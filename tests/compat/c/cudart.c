/* cudart: a program linked against the real CUDA runtime (libcudart, from NVIDIA's PyPI
 * wheels) for the compatibility tests: cudaGetDeviceCount makes the runtime find the
 * driver (dlopen, cuGetProcAddress, every entry point by name) and prints what it
 * answered. Declared here, not from cuda_runtime_api.h: two functions of a stable ABI. */
#include <stdio.h>

extern int cudaGetDeviceCount(int *count);
extern const char *cudaGetErrorName(int error);
extern int cudaRuntimeGetVersion(int *version);

int main(void) {
  int version = 0, n = -1;
  cudaRuntimeGetVersion(&version);
  int r = cudaGetDeviceCount(&n);
  printf("runtime %d: cudaGetDeviceCount = %d (%s), count %d\n", version, r, cudaGetErrorName(r), n);
  return 0;
}
