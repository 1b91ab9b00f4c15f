/*
 * tsg_fake_rm.c: a stand-in for the RM's ioctl interface, for testing tsg_hook.c without
 * a GPU (tsg_check.py). Preloaded after the hook (LD_PRELOAD="hook.so fake.so"), so the
 * hook's next ioctl is this one. Every file under COLOC_TSG_FAKE_DIR is a fake RM device;
 * ioctls on other descriptors go to the C library.
 *
 * It answers as the driver would (escape number and size from _IOC_NR / _IOC_SIZE, or the
 * nv_ioctl_xfer_t of NV_ESC_IOCTL_XFER_CMD):
 *   NV_ESC_RM_ALLOC (NVOS21 or NVOS64): status 0, a handle when hObjectNew is 0; status
 *     0x1f (NV_ERR_INVALID_ARGUMENT) for hObjectNew 0xbad00bad. A client (class 0x41) is
 *     bound to the descriptor it was allocated on.
 *   NV_ESC_RM_FREE (NVOS00): status 0.
 *   NV_ESC_RM_CONTROL (NVOS54): GET_TIMESLICE / SET_TIMESLICE of a channel group it
 *     allocated; 0x23 (NV_ERR_INVALID_CLIENT) through another descriptor than the client's,
 *     0x33 (NV_ERR_INVALID_OBJECT_HANDLE) for an unknown group, 0x1f for a slice under
 *     COLOC_TSG_FAKE_MIN_US (default 100); a group's slice starts at 2048 us.
 * Each control is logged to COLOC_TSG_FAKE_LOG, one line: "fd REQ NVOS54-hex PARAMS-hex"
 * (the bytes as the caller passed them, before the answer).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

static int (*next_ioctl)(int, unsigned long, ...);
static uint32_t next_handle = 0xc1d00001u;
static struct {
    uint32_t client, object;
    int fd;
    uint64_t slice;
    int is_client;
} objs[256];
static int nobjs;

static int fake_fd(int fd) {
    const char *dir = getenv("COLOC_TSG_FAKE_DIR");
    char link[64], path[PATH_MAX];
    if (!dir)
        return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0)
        return 0;
    path[n] = 0;
    size_t l = strlen(dir);
    return strncmp(path, dir, l) == 0 && path[l] == '/';
}

static void hex(FILE *f, const void *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%02x", ((const unsigned char *)p)[i]);
}

static uint32_t alloc(int fd, uint32_t *root, uint32_t *obj, uint32_t cls) {
    if (*obj == 0xbad00badu)
        return 0x1f;
    if (*obj == 0)
        *obj = next_handle++;
    if (cls == 0x41)
        *root = *obj;
    if (nobjs < 256)
        objs[nobjs++] = (typeof(objs[0])){*root, *obj, fd, 2048, cls == 0x41};
    return 0;
}

static uint32_t control(int fd, unsigned long req, uint32_t *p) {
    /* NVOS54: hClient, hObject, cmd, flags, params (u64 at byte 16), paramsSize, status */
    uint64_t ptr;
    memcpy(&ptr, (char *)p + 16, 8);
    uint32_t size = p[6];
    const char *logp = getenv("COLOC_TSG_FAKE_LOG");
    if (logp) {
        FILE *f = fopen(logp, "a");
        if (f) {
            fprintf(f, "%d %lx ", fd, req);
            hex(f, p, 32);
            fputc(' ', f);
            if (ptr && size <= 64)
                hex(f, (void *)(uintptr_t)ptr, size);
            fputc('\n', f);
            fclose(f);
        }
    }
    int c = -1, o = -1;
    for (int i = 0; i < nobjs; i++) {
        if (objs[i].is_client && objs[i].client == p[0])
            c = i;
        if (!objs[i].is_client && objs[i].client == p[0] && objs[i].object == p[1])
            o = i;
    }
    if (c < 0 || objs[c].fd != fd)
        return 0x23;
    if (o < 0)
        return 0x33;
    if (size != 8 || !ptr)
        return 0x3a;
    uint64_t *us = (uint64_t *)(uintptr_t)ptr;
    const char *m = getenv("COLOC_TSG_FAKE_MIN_US");
    uint64_t min = m ? strtoull(m, NULL, 0) : 100;
    if (p[2] == 0xa06c0104u) {
        *us = objs[o].slice;
        return 0;
    }
    if (p[2] == 0xa06c0103u) {
        if (*us < min)
            return 0x1f;
        objs[o].slice = *us;
        return 0;
    }
    return 0x24;
}

int ioctl(int fd, unsigned long req, ...) {
    va_list ap;
    va_start(ap, req);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    if (!next_ioctl)
        next_ioctl = (int (*)(int, unsigned long, ...))dlsym(RTLD_NEXT, "ioctl");
    if (!fake_fd(fd))
        return next_ioctl(fd, req, arg);
    unsigned nr = _IOC_NR(req), size = _IOC_SIZE(req);
    void *p = arg;
    if (nr == 200 + 11) { /* NV_ESC_IOCTL_XFER_CMD */
        uint32_t *x = arg;
        uint64_t ptr;
        memcpy(&ptr, (char *)arg + 8, 8);
        nr = x[0];
        size = x[1];
        p = (void *)(uintptr_t)ptr;
    }
    uint32_t *u = p;
    if (nr == 0x2B && (size == 32 || size == 48)) {
        uint32_t *status = size == 32 ? &u[7] : &u[10];
        *status = alloc(fd, &u[0], &u[2], u[3]);
        return 0;
    }
    if (nr == 0x29 && size == 16) {
        u[3] = 0;
        return 0;
    }
    if (nr == 0x2A && size == 32) {
        u[7] = control(fd, req, u);
        return 0;
    }
    errno = EINVAL;
    return -1;
}
