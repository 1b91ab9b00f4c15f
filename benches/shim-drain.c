/* shim-drain: the online shim's completion stamps and its cost per launch, on a real GPU
 * or on the fake driver (benches/shim-drain.sh runs it). It reaches the driver as the CUDA
 * runtime does (dlopen("libcuda.so.1"), cuGetProcAddress_v2, every entry point by name),
 * so a preloaded libcoloc_cuda.so sees every call.
 *
 *   shim-drain check    each rule once; one line per step: what the page says after it
 *   shim-drain cost N   N batches of 500 empty-kernel launches: ns per launch, min and median;
 *                       then N batches of 100 stream and context synchronizes with nothing
 *                       left to wait for: ns per call
 *
 * The kernel busy-waits for the nanoseconds in its first parameter (%globaltimer), as the
 * fake driver's kernels run for theirs. The page is read as the agent reads it: the one
 * .bell file in COLOC_DOORBELL_DIR, mapped read-only, the first entry's last_launch_ns
 * (byte 24) and drained_ns (byte 80); nothing is read without that directory. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef void *H;
typedef CUresult (*getter_fn)(const char *, void **, int, unsigned long long, int *);

static const char PTX[] =
    ".version 7.0\n.target sm_50\n.address_size 64\n"
    ".visible .entry spin(.param .u64 ns) {\n"
    "  .reg .u64 %t0, %t1, %d, %n;\n  .reg .pred %p;\n"
    "  ld.param.u64 %n, [ns];\n  mov.u64 %t0, %globaltimer;\n"
    "LOOP:\n  mov.u64 %t1, %globaltimer;\n  sub.u64 %d, %t1, %t0;\n"
    "  setp.lt.u64 %p, %d, %n;\n  @%p bra LOOP;\n  ret;\n}\n";

static getter_fn get_proc;
static CUresult (*launch_kernel)(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 unsigned, H, void **, void **);
static CUresult (*stream_sync)(H), (*ctx_sync)(void), (*event_record)(H, H),
    (*event_sync)(H), (*dtoh)(void *, unsigned long long, size_t);
static H func, s1, s2, ev;
static unsigned long long dbuf;
static const volatile unsigned char *page;
static int failures;

static void *get(const char *name) {
  void *p = NULL;
  int q = 0;
  CUresult r = get_proc(name, &p, 12040, 0, &q);
  if (r || !p) {
    fprintf(stderr, "cuGetProcAddress(%s): %d\n", name, r);
    exit(2);
  }
  return p;
}

#define CK(x)                                                      \
  do {                                                             \
    CUresult r_ = (x);                                             \
    if (r_) {                                                      \
      fprintf(stderr, "%s:%d %s: %d\n", __FILE__, __LINE__, #x, r_); \
      exit(2);                                                     \
    }                                                              \
  } while (0)

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static uint64_t mono_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void launch(H s, uint64_t ns) {
  void *params[] = {&ns};
  CK(launch_kernel(func, 1, 1, 1, 1, 1, 1, 0, s, params, NULL));
}

static void map_page(void) {
  const char *dir = getenv("COLOC_DOORBELL_DIR");
  if (!dir || page) return;
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d && (e = readdir(d))) {
    size_t n = strlen(e->d_name);
    if (n > 5 && !strcmp(e->d_name + n - 5, ".bell")) {
      char path[4096];
      snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
      int fd = open(path, O_RDONLY);
      if (fd >= 0) {
        void *m = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
        if (m != MAP_FAILED) page = m;
        close(fd);
      }
      break;
    }
  }
  if (d) closedir(d);
}

static uint64_t word(size_t off) {
  return page ? *(const volatile uint64_t *)(page + 64 + off) : 0;
}

/* One step: what the page says, and whether the stamp is what the rule wants:
 * want > 0: a stamp at least `want` ns after the latest launch, no later than `until`;
 * want == 0: the stamp did not move from `before`. */
static void step(const char *what, uint64_t before, int64_t want, uint64_t until) {
  map_page();
  uint64_t last = word(24), drained = word(80);
  int ok = want > 0 ? drained >= last + (uint64_t)want && drained <= until
                    : drained == before;
  if (!page) ok = 1;
  failures += !ok;
  printf("%-40s %s  stamp - last launch %+8.3f ms", what,
         page ? (ok ? "ok  " : "FAIL") : "-   ", ((double)drained - (double)last) / 1e6);
  if (want > 0)
    printf("  call's return - stamp %+7.3f ms\n", ((double)until - (double)drained) / 1e6);
  else
    printf("  (stamp %s)\n", drained == before ? "unchanged" : "MOVED");
}

static void check(void) {
  const uint64_t ms = 1000000;
  /* A request: kernels launched at once, then the stream's sync. */
  launch(s1, 10 * ms);
  launch(s1, 10 * ms);
  CK(stream_sync(s1));
  step("stream sync after 2 x 10 ms", 0, 15 * ms, now_ns());
  uint64_t d = word(80);
  /* Work on two streams: neither stream's sync covers it; the context's does. */
  launch(s1, 20 * ms);
  launch(s2, 1 * ms);
  CK(stream_sync(s2));
  step("s2 sync, work on s1 and s2", d, 0, 0);
  CK(ctx_sync());
  step("context sync after 20 ms on s1", 0, 15 * ms, now_ns());
  d = word(80);
  /* An event recorded after the work; then one recorded before a launch. */
  launch(s1, 10 * ms);
  CK(event_record(ev, s1));
  CK(event_sync(ev));
  step("event sync after 10 ms", 0, 5 * ms, now_ns());
  d = word(80);
  launch(s1, 5 * ms);
  CK(event_record(ev, s1));
  launch(s1, 20 * ms);
  CK(event_sync(ev));
  step("event sync, a launch after its record", d, 0, 0);
  CK(ctx_sync());
  /* A device-to-host copy on the legacy default stream. */
  launch(NULL, 10 * ms);
  char host[64];
  CK(dtoh(host, dbuf, sizeof host));
  step("DtoH after 10 ms on the legacy stream", 0, 5 * ms, now_ns());
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void cost(int batches) {
  enum { PER = 500 };
  double *v = calloc((size_t)batches, sizeof *v);
  for (int i = 0; i < 20; i++) launch(s1, 0); /* warm */
  CK(stream_sync(s1));
  for (int b = 0; b < batches; b++) {
    uint64_t t0 = mono_ns();
    for (int i = 0; i < PER; i++) launch(s1, 0);
    v[b] = (double)(mono_ns() - t0) / PER;
    CK(stream_sync(s1));
  }
  qsort(v, (size_t)batches, sizeof *v, cmp);
  printf("launch ns: min %.1f  p25 %.1f  median %.1f  (%d batches of %d)", v[0],
         v[batches / 4], v[batches / 2], batches, PER);
  /* The synchronising calls' own cost: nothing left to wait for. */
  for (int k = 0; k < 2; k++) {
    for (int b = 0; b < batches; b++) {
      uint64_t t0 = mono_ns();
      for (int i = 0; i < PER / 5; i++) CK(k ? ctx_sync() : stream_sync(s1));
      v[b] = (double)(mono_ns() - t0) / (PER / 5);
    }
    qsort(v, (size_t)batches, sizeof *v, cmp);
    printf("; idle %s ns: min %.1f  median %.1f", k ? "cuCtxSynchronize" : "cuStreamSynchronize",
           v[0], v[batches / 2]);
  }
  printf("\n");
  free(v);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: shim-drain check | cost N\n");
    return 2;
  }
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) {
    fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
    return 2;
  }
  get_proc = (getter_fn)dlsym(h, "cuGetProcAddress_v2");
  if (!get_proc) return 2;
  CUresult (*init)(unsigned) = get("cuInit");
  CUresult (*dev_get)(int *, int) = get("cuDeviceGet");
  CUresult (*retain)(H *, int) = get("cuDevicePrimaryCtxRetain");
  CUresult (*set)(H) = get("cuCtxSetCurrent");
  CUresult (*load)(H *, const void *) = get("cuModuleLoadData");
  CUresult (*getf)(H *, H, const char *) = get("cuModuleGetFunction");
  CUresult (*screate)(H *, unsigned) = get("cuStreamCreate");
  CUresult (*ecreate)(H *, unsigned) = get("cuEventCreate");
  CUresult (*alloc)(unsigned long long *, size_t) = get("cuMemAlloc");
  launch_kernel = get("cuLaunchKernel");
  stream_sync = get("cuStreamSynchronize");
  ctx_sync = get("cuCtxSynchronize");
  event_record = get("cuEventRecord");
  event_sync = get("cuEventSynchronize");
  dtoh = get("cuMemcpyDtoH");
  int dev;
  H ctx, mod;
  CK(init(0));
  CK(dev_get(&dev, 0));
  CK(retain(&ctx, dev));
  CK(set(ctx));
  CK(load(&mod, PTX));
  CK(getf(&func, mod, "spin"));
  CK(screate(&s1, 1));
  CK(screate(&s2, 1));
  CK(ecreate(&ev, 0));
  CK(alloc(&dbuf, 4096));
  if (!strcmp(argv[1], "check")) {
    check();
    printf("%s\n", failures ? "FAILED" : "all steps as expected");
    return failures != 0;
  }
  if (!strcmp(argv[1], "cost") && argc > 2) {
    cost(atoi(argv[2]));
    return 0;
  }
  return 2;
}
