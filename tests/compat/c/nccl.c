/* nccl: a program linked against the real NCCL (libnccl.so.2, from NVIDIA's PyPI wheel
 * nvidia-nccl-cu12) for the compatibility tests. NCCL carries its own CUDA runtime and
 * reaches the driver itself; ncclCommInitAll makes it find the driver (dlopen,
 * cuGetProcAddress, its entry points by name) and prints what it answered. Declared here,
 * not from nccl.h: three functions of a stable ABI. */
#include <stdio.h>

typedef struct ncclComm *ncclComm_t;
extern int ncclGetVersion(int *version);
extern int ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist);
extern const char *ncclGetErrorString(int result);

int main(void) {
  int version = 0;
  ncclGetVersion(&version);
  ncclComm_t comm = 0;
  int dev = 0;
  int r = ncclCommInitAll(&comm, 1, &dev);
  printf("nccl %d: ncclCommInitAll = %d (%s)\n", version, r, ncclGetErrorString(r));
  return 0;
}
