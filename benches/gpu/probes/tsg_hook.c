/*
 * tsg_hook.c: learn this process's channel groups from its own RM ioctls, and set their
 * time slice (probe 2a of the GPU harness: benches/gpu/probes/README.md).
 *
 * Loaded with LD_PRELOAD into a CUDA process. It wraps ioctl(2): every NV_ESC_RM_ALLOC
 * that succeeds on the RM control device (COLOC_TSG_CTL, default /dev/nvidiactl) is
 * counted, its client handle (hRoot) remembered, and an allocation of the channel-group
 * class KEPLER_CHANNEL_GROUP_A (0xA06C) recorded with the descriptor it went through;
 * NV_ESC_RM_FREE of a recorded group forgets it. The process then calls (ctypes):
 *
 *   int coloc_tsg_count(void)                      recorded channel groups
 *   int coloc_tsg_info(int i, uint32_t out[4])     fd, client, parent, object of group i
 *   void coloc_tsg_seen(uint32_t out[3])           RM allocs seen, clients seen, groups ever
 *   int coloc_tsg_get_timeslice(int i, uint64_t *us)
 *   int coloc_tsg_set_timeslice(int i, uint64_t us)
 *
 * The last two issue NV_ESC_RM_CONTROL (NVA06C_CTRL_CMD_GET_TIMESLICE / SET_TIMESLICE) on
 * the group's own descriptor: the RM binds a client to the file it was allocated on
 * (rmclientValidate: pClient->pOSInfo against the caller's file), so another descriptor
 * would be refused. They return the RM status (0: NV_OK, e.g. 0x1f NV_ERR_INVALID_ARGUMENT)
 * or a negative errno when the ioctl itself failed (-ERANGE: no group i).
 *
 * Layouts, escape numbers and command ids, from NVIDIA's open kernel modules (595.45.04,
 * commit df1c9a3de2be4b130f4fc7680f7198193d8ac6ad), cross-checked with gVisor's
 * pkg/abi/nvgpu/frontend.go:
 *   kernel-open/common/inc/nv-ioctl-numbers.h  NV_IOCTL_MAGIC 'F', NV_IOCTL_BASE 200,
 *                                              NV_ESC_IOCTL_XFER_CMD = BASE + 11
 *   kernel-open/common/inc/nv-ioctl.h          nv_ioctl_xfer_t {u32 cmd, u32 size, u64 ptr}
 *   kernel-open/nvidia/nv.c (nvidia_ioctl)     dispatches on _IOC_NR and _IOC_SIZE only
 *                                              (the type byte is not checked); XFER
 *                                              carries the real escape and size
 *   src/nvidia/arch/nvalloc/unix/include/nv_escape.h
 *                                              NV_ESC_RM_FREE 0x29, RM_CONTROL 0x2A,
 *                                              RM_ALLOC 0x2B
 *   src/nvidia/arch/nvalloc/unix/src/escape.c  RM_ALLOC takes NVOS21 (32 bytes) or
 *                                              NVOS64 (48 bytes), told apart by size;
 *                                              RM_CONTROL takes NVOS54 (32 bytes), on the
 *                                              control device only
 *   src/common/sdk/nvidia/inc/nvos.h           NVOS00, NVOS21, NVOS64, NVOS54 below
 *   src/common/sdk/nvidia/inc/class/cla06c.h   KEPLER_CHANNEL_GROUP_A 0xA06C
 *   src/common/sdk/nvidia/inc/ctrl/ctrla06c.h  SET_TIMESLICE 0xa06c0103, GET_TIMESLICE
 *                                              0xa06c0104, params {u64 timesliceUs}
 *   src/nvidia/generated/g_kernel_channel_group_api_nvoc.c
 *                                              both exported with RMCTRL_FLAGS_NON_PRIVILEGED
 *                                              (a process may call them on its own groups)
 *
 * Build: cc -O2 -shared -fPIC -o libcoloc_tsg_hook.so tsg_hook.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#define NV_IOCTL_MAGIC 'F'
#define NV_ESC_IOCTL_XFER_CMD (200 + 11)
#define NV_ESC_RM_FREE 0x29
#define NV_ESC_RM_CONTROL 0x2A
#define NV_ESC_RM_ALLOC 0x2B
#define KEPLER_CHANNEL_GROUP_A 0xA06Cu
#define NVA06C_CTRL_CMD_SET_TIMESLICE 0xa06c0103u
#define NVA06C_CTRL_CMD_GET_TIMESLICE 0xa06c0104u

typedef struct {
    uint32_t cmd, size;
    uint64_t ptr __attribute__((aligned(8)));
} nv_xfer;
typedef struct {
    uint32_t hRoot, hObjectParent, hObjectOld, status;
} nvos00;
typedef struct {
    uint32_t hRoot, hObjectParent, hObjectNew, hClass;
    uint64_t pAllocParms __attribute__((aligned(8)));
    uint32_t paramsSize, status;
} nvos21;
typedef struct {
    uint32_t hRoot, hObjectParent, hObjectNew, hClass;
    uint64_t pAllocParms __attribute__((aligned(8)));
    uint64_t pRightsRequested __attribute__((aligned(8)));
    uint32_t paramsSize, flags, status;
} nvos64;
typedef struct {
    uint32_t hClient, hObject, cmd, flags;
    uint64_t params __attribute__((aligned(8)));
    uint32_t paramsSize, status;
} nvos54;
typedef struct {
    uint64_t timesliceUs __attribute__((aligned(8)));
} nva06c_timeslice;

_Static_assert(sizeof(nv_xfer) == 16, "nv_ioctl_xfer_t");
_Static_assert(sizeof(nvos00) == 16, "NVOS00_PARAMETERS");
_Static_assert(sizeof(nvos21) == 32, "NVOS21_PARAMETERS");
_Static_assert(sizeof(nvos64) == 48, "NVOS64_PARAMETERS");
_Static_assert(sizeof(nvos54) == 32, "NVOS54_PARAMETERS");
_Static_assert(sizeof(nva06c_timeslice) == 8, "NVA06C_CTRL_TIMESLICE_PARAMS");

#define MAX_GROUPS 256
#define MAX_CLIENTS 64

struct group {
    int fd;
    uint32_t client, parent, object;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct group groups[MAX_GROUPS];
static int ngroups;
static uint32_t clients[MAX_CLIENTS];
static uint32_t nclients, allocs_seen, groups_ever;
static int (*real_ioctl)(int, unsigned long, ...);
static char ctl_path[PATH_MAX];
static int trace;

static void init(void) {
    real_ioctl = (int (*)(int, unsigned long, ...))dlsym(RTLD_NEXT, "ioctl");
    const char *p = getenv("COLOC_TSG_CTL");
    snprintf(ctl_path, sizeof ctl_path, "%s", p && *p ? p : "/dev/nvidiactl");
    trace = getenv("COLOC_TSG_TRACE") != NULL;
}

static pthread_once_t once = PTHREAD_ONCE_INIT;

/* Whether fd is the RM control device (its path, as /proc/self/fd shows it). */
static int is_ctl(int fd) {
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0)
        return 0;
    path[n] = 0;
    return strcmp(path, ctl_path) == 0;
}

static void note_alloc(int fd, uint32_t client, uint32_t parent, uint32_t object, uint32_t cls) {
    pthread_mutex_lock(&mu);
    allocs_seen++;
    uint32_t i;
    for (i = 0; i < nclients && clients[i] != client; i++)
        ;
    if (i == nclients && nclients < MAX_CLIENTS)
        clients[nclients++] = client;
    if (cls == KEPLER_CHANNEL_GROUP_A && ngroups < MAX_GROUPS) {
        groups[ngroups++] = (struct group){fd, client, parent, object};
        groups_ever++;
    }
    pthread_mutex_unlock(&mu);
    if (trace && cls == KEPLER_CHANNEL_GROUP_A)
        fprintf(stderr, "coloc-tsg: channel group 0x%x (client 0x%x, parent 0x%x, fd %d)\n", object, client, parent, fd);
}

static void note_free(uint32_t client, uint32_t object) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < ngroups; i++) {
        if (groups[i].client == client && groups[i].object == object) {
            groups[i] = groups[--ngroups];
            break;
        }
    }
    pthread_mutex_unlock(&mu);
}

/* After a successful call: what an RM escape of `size` bytes at `arg` tells. */
static void observe(int fd, unsigned nr, size_t size, void *arg) {
    if (arg == NULL || !(nr == NV_ESC_RM_ALLOC || nr == NV_ESC_RM_FREE) || !is_ctl(fd))
        return;
    if (nr == NV_ESC_RM_ALLOC && size == sizeof(nvos21)) {
        nvos21 *a = arg;
        if (a->status == 0)
            note_alloc(fd, a->hRoot, a->hObjectParent, a->hObjectNew, a->hClass);
    } else if (nr == NV_ESC_RM_ALLOC && size == sizeof(nvos64)) {
        nvos64 *a = arg;
        if (a->status == 0)
            note_alloc(fd, a->hRoot, a->hObjectParent, a->hObjectNew, a->hClass);
    } else if (nr == NV_ESC_RM_FREE && size == sizeof(nvos00)) {
        nvos00 *a = arg;
        if (a->status == 0)
            note_free(a->hRoot, a->hObjectOld);
    }
}

int ioctl(int fd, unsigned long req, ...) {
    va_list ap;
    va_start(ap, req);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    pthread_once(&once, init);
    if (!real_ioctl) {
        errno = ENOSYS;
        return -1;
    }
    int rc = real_ioctl(fd, req, arg);
    /* The driver dispatches on the number and size alone (not the type byte): so do we. */
    if (rc == 0) {
        unsigned nr = _IOC_NR(req);
        if (nr == NV_ESC_IOCTL_XFER_CMD && _IOC_SIZE(req) == sizeof(nv_xfer) && arg) {
            nv_xfer *x = arg;
            observe(fd, x->cmd, x->size, (void *)(uintptr_t)x->ptr);
        } else {
            observe(fd, nr, _IOC_SIZE(req), arg);
        }
    }
    return rc;
}

int coloc_tsg_count(void) {
    pthread_mutex_lock(&mu);
    int n = ngroups;
    pthread_mutex_unlock(&mu);
    return n;
}

int coloc_tsg_info(int i, uint32_t out[4]) {
    int ok = 0;
    pthread_mutex_lock(&mu);
    if (i >= 0 && i < ngroups) {
        out[0] = (uint32_t)groups[i].fd;
        out[1] = groups[i].client;
        out[2] = groups[i].parent;
        out[3] = groups[i].object;
        ok = 1;
    }
    pthread_mutex_unlock(&mu);
    return ok ? 0 : -ERANGE;
}

void coloc_tsg_seen(uint32_t out[3]) {
    pthread_mutex_lock(&mu);
    out[0] = allocs_seen;
    out[1] = nclients;
    out[2] = groups_ever;
    pthread_mutex_unlock(&mu);
}

/* One NVA06C control on group i: the RM status, or -errno. */
static int control(int i, uint32_t cmd, nva06c_timeslice *p) {
    pthread_once(&once, init);
    struct group g;
    pthread_mutex_lock(&mu);
    int ok = i >= 0 && i < ngroups;
    if (ok)
        g = groups[i];
    pthread_mutex_unlock(&mu);
    if (!ok)
        return -ERANGE;
    if (!real_ioctl)
        return -ENOSYS;
    nvos54 c;
    memset(&c, 0, sizeof c);
    c.hClient = g.client;
    c.hObject = g.object;
    c.cmd = cmd;
    c.flags = 0;
    c.params = (uint64_t)(uintptr_t)p;
    c.paramsSize = sizeof *p;
    if (real_ioctl(g.fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_CONTROL, nvos54), &c) != 0)
        return -errno;
    return (int)c.status;
}

int coloc_tsg_get_timeslice(int i, uint64_t *us) {
    nva06c_timeslice p = {0};
    int st = control(i, NVA06C_CTRL_CMD_GET_TIMESLICE, &p);
    if (st == 0 && us)
        *us = p.timesliceUs;
    return st;
}

int coloc_tsg_set_timeslice(int i, uint64_t us) {
    nva06c_timeslice p = {us};
    return control(i, NVA06C_CTRL_CMD_SET_TIMESLICE, &p);
}
