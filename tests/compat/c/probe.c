/* probe: a CUDA driver-API program for the compatibility tests (tests/compat).
 *
 * It reaches the driver as the CUDA 12 runtime does: dlopen("libcuda.so.1"),
 * dlsym(h, "cuGetProcAddress_v2"), every other entry point through that getter. It also
 * looks up a driver name and an NVML name with dlsym, as the runtime and NVML users do,
 * so that an interposer can be seen to see them.
 *
 *   probe launch N NS     N launches of a kernel busy NS ns on the fake driver (1 ms
 *                         apart; N = 0: for ever), printing "launched I" after each;
 *                         then waits for stdin to close
 *   probe alloc BYTES     prints "alloc RESULT" for cuMemAlloc_v2(BYTES)
 *   probe dlopen          only dlopen and dlsym (no driver call): "dlopen ok"
 *
 * Built for glibc 2.17 by scripts/build-compat (Zig), so that it runs in old userlands.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*getter_fn)(const char *, void **, int, unsigned long long, int *);

static getter_fn get;

static void *need(const char *name) {
  void *p = NULL;
  int status = 0;
  CUresult r = get(name, &p, 12000, 0, &status);
  if (r != 0 || p == NULL) {
    printf("missing %s (%d)\n", name, r);
    exit(3);
  }
  return p;
}

static void check(const char *what, CUresult r) {
  if (r != 0) {
    printf("%s failed: %d\n", what, r);
    exit(4);
  }
}

static void wait_stdin(void) {
  char buf[64];
  while (read(0, buf, sizeof buf) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: probe launch N NS | alloc BYTES | dlopen\n");
    return 1;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    printf("no driver: %s\n", dlerror());
    return 2;
  }
  get = (getter_fn)dlsym(h, "cuGetProcAddress_v2");
  /* Looked up as the runtime and NVML users do (answers not used). */
  (void)dlsym(h, "cuDriverGetVersion");
  (void)dlsym(RTLD_DEFAULT, "nvmlInit_v2");
  if (strcmp(argv[1], "dlopen") == 0) {
    printf("dlopen ok\n");
    return 0;
  }
  if (!get) {
    printf("no cuGetProcAddress_v2\n");
    return 2;
  }
  CUdevice dev;
  CUcontext ctx;
  check("cuInit", ((CUresult(*)(unsigned))need("cuInit"))(0));
  check("cuDeviceGet", ((CUresult(*)(CUdevice *, int))need("cuDeviceGet"))(&dev, 0));
  check("cuCtxCreate", ((CUresult(*)(CUcontext *, unsigned, CUdevice))need("cuCtxCreate"))(&ctx, 0, dev));
  if (strcmp(argv[1], "alloc") == 0 && argc >= 3) {
    CUdeviceptr p = 0;
    size_t n = strtoull(argv[2], NULL, 10);
    printf("alloc %d\n", ((CUresult(*)(CUdeviceptr *, size_t))need("cuMemAlloc"))(&p, n));
    return 0;
  }
  if (strcmp(argv[1], "launch") == 0 && argc >= 4) {
    long n = strtol(argv[2], NULL, 10);
    uint64_t ns = strtoull(argv[3], NULL, 10);
    CUmodule m;
    CUfunction f;
    check("cuModuleLoadData", ((CUresult(*)(CUmodule *, const void *))need("cuModuleLoadData"))(&m, "probe"));
    check("cuModuleGetFunction",
          ((CUresult(*)(CUfunction *, CUmodule, const char *))need("cuModuleGetFunction"))(&f, m, "k"));
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void **, void **) = need("cuLaunchKernel");
    for (long i = 0; n == 0 || i < n; i++) {
      void *params[] = {&ns};
      check("cuLaunchKernel", launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
      printf("launched %ld\n", i + 1);
      usleep(1000);
    }
    wait_stdin();
    return 0;
  }
  fprintf(stderr, "unknown mode %s\n", argv[1]);
  return 1;
}
