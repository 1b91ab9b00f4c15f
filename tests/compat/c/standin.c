/* standin: an interposer that reaches the CUDA driver the way HAMi-core does (facts from
 * its public documentation and source; none of its code), for the compatibility tests.
 *
 * - It defines dlsym (unversioned) and finds "the real dlsym" with
 *   dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5") ("GLIBC_2.17" on aarch64).
 * - dlsym of a name starting with "cu" that it hooks answers that real dlsym's lookup of
 *   the name in its own library (a handle of itself); every other lookup goes to that
 *   real dlsym with the caller's handle.
 * - Its hooks are compiled with default visibility and referred to by address
 *   ((void *)cuLaunchKernel): an interposer loaded before it that exports the same name
 *   is what that address resolves to, as in HAMi-core.
 * - Its table of the driver's functions is loaded through that real dlsym from its own
 *   dlopen("libcuda.so.1").
 * - cuGetProcAddress and cuGetProcAddress_v2 answer its own hooks by base name, else the
 *   driver's getter.
 * - cuMemAlloc_v2 refuses an allocation over CUDA_DEVICE_MEMORY_LIMIT (bytes) with
 *   CUDA_ERROR_OUT_OF_MEMORY (2); cuLaunchKernel counts launches.
 *
 * Every lookup it sees is written to the file STANDIN_LOG names ("dlsym NAME",
 * "getter NAME"), and at exit "launches N".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__aarch64__)
#define GLIBC_DLSYM_VERSION "GLIBC_2.17"
#else
#define GLIBC_DLSYM_VERSION "GLIBC_2.2.5"
#endif

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*getter_fn)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*getter1_fn)(const char *, void **, int, unsigned long long);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                              void **, void **);

static void *(*real_dlsym)(void *, const char *);
static void *self;
static pthread_once_t dlsym_once = PTHREAD_ONCE_INIT;
static pthread_once_t table_once = PTHREAD_ONCE_INIT;
static getter_fn real_getter_v2;
static getter1_fn real_getter;
static alloc_fn real_alloc;
static launch_fn real_launch;
static volatile long launches;

static void log_line(const char *via, const char *name) {
  const char *path = getenv("STANDIN_LOG");
  if (!path || !name)
    return;
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    return;
  char line[512];
  int n = snprintf(line, sizeof line, "%s %s\n", via, name);
  if (n > 0)
    (void)!write(fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
  close(fd);
}

static void find_real_dlsym(void) {
  real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", GLIBC_DLSYM_VERSION);
  Dl_info info;
  if (dladdr((void *)find_real_dlsym, &info) && info.dli_fname)
    self = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
}

static void load_table(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h || !real_dlsym)
    return;
  real_getter_v2 = (getter_fn)real_dlsym(h, "cuGetProcAddress_v2");
  real_getter = (getter1_fn)real_dlsym(h, "cuGetProcAddress");
  real_alloc = (alloc_fn)real_dlsym(h, "cuMemAlloc_v2");
  real_launch = (launch_fn)real_dlsym(h, "cuLaunchKernel");
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status);
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags);
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n);
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shm, void *stream, void **params, void **extra);

/* Its own hook for `name` (an exported or a base name), or NULL. */
static void *own(const char *name) {
  if (!strcmp(name, "cuGetProcAddress_v2"))
    return (void *)cuGetProcAddress_v2;
  if (!strcmp(name, "cuGetProcAddress"))
    return (void *)cuGetProcAddress;
  if (!strcmp(name, "cuMemAlloc") || !strcmp(name, "cuMemAlloc_v2"))
    return (void *)cuMemAlloc_v2;
  if (!strcmp(name, "cuLaunchKernel"))
    return (void *)cuLaunchKernel;
  return NULL;
}

void *dlsym(void *handle, const char *name) {
  pthread_once(&dlsym_once, find_real_dlsym);
  log_line("dlsym", name);
  if (name[0] == 'c' && name[1] == 'u') {
    pthread_once(&table_once, load_table);
    if (own(name) && self && real_dlsym) {
      void *f = real_dlsym(self, name);
      if (f)
        return f;
    }
  }
  return real_dlsym ? real_dlsym(handle, name) : NULL;
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
  pthread_once(&table_once, load_table);
  log_line("getter", sym);
  void *f = own(sym);
  if (f) {
    *pfn = f;
    if (status)
      *status = 1; /* CU_GET_PROC_ADDRESS_SUCCESS */
    return 0;
  }
  return real_getter_v2 ? real_getter_v2(sym, pfn, ver, flags, status) : 500;
}

CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
  pthread_once(&table_once, load_table);
  log_line("getter", sym);
  void *f = own(sym);
  if (f) {
    *pfn = f;
    return 0;
  }
  return real_getter ? real_getter(sym, pfn, ver, flags) : 500;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  const char *limit = getenv("CUDA_DEVICE_MEMORY_LIMIT");
  if (limit && n > strtoull(limit, NULL, 10))
    return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
  return real_alloc ? real_alloc(p, n) : 500;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shm, void *stream, void **params, void **extra) {
  __atomic_add_fetch(&launches, 1, __ATOMIC_RELAXED);
  return real_launch ? real_launch(f, gx, gy, gz, bx, by, bz, shm, stream, params, extra) : 500;
}

__attribute__((destructor)) static void report(void) {
  char n[32];
  snprintf(n, sizeof n, "%ld", launches);
  log_line("launches", n);
}
