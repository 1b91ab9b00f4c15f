#!/usr/bin/env python3
"""A directory whose fsync/fdatasync is slow: a FUSE passthrough over a backing directory
that sleeps before each sync, for benchmarking the agent with a slow --state-dir.

    python3 benches/slow-dir.py BACKING MOUNTPOINT [--sync-ms 20] [--jitter-ms 0]

Mounts in the foreground until killed (SIGTERM/SIGINT unmount it). Each fsync or
fdatasync sleeps --sync-ms (plus up to --jitter-ms, uniformly), then syncs the backing
file. Everything else passes through. Needs root, /dev/fuse, libfuse2 and fusepy
(Debian: apt-get install libfuse2; PyPI: fusepy==3.0.1).
"""
import argparse
import errno
import os
import random
import time

from fuse import FUSE, FuseOSError, Operations


class SlowSync(Operations):
    def __init__(self, root, sync_s, jitter_s):
        self.root = os.path.realpath(root)
        self.sync_s = sync_s
        self.jitter_s = jitter_s

    def _p(self, path):
        return os.path.join(self.root, path.lstrip("/"))

    def _sleep(self):
        time.sleep(self.sync_s + random.uniform(0, self.jitter_s))

    def access(self, path, mode):
        if not os.access(self._p(path), mode):
            raise FuseOSError(errno.EACCES)

    def chmod(self, path, mode):
        return os.chmod(self._p(path), mode)

    def chown(self, path, uid, gid):
        return os.chown(self._p(path), uid, gid)

    def getattr(self, path, fh=None):
        st = os.lstat(self._p(path))
        keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")
        return {k: getattr(st, k) for k in keys}

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._p(path))

    def readlink(self, path):
        return os.readlink(self._p(path))

    def mkdir(self, path, mode):
        return os.mkdir(self._p(path), mode)

    def rmdir(self, path):
        return os.rmdir(self._p(path))

    def unlink(self, path):
        return os.unlink(self._p(path))

    def symlink(self, name, target):
        return os.symlink(target, self._p(name))

    def rename(self, old, new):
        return os.rename(self._p(old), self._p(new))

    def link(self, target, name):
        return os.link(self._p(name), self._p(target))

    def utimens(self, path, times=None):
        return os.utime(self._p(path), times)

    def statfs(self, path):
        st = os.statvfs(self._p(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")
        return {k: getattr(st, k) for k in keys}

    def open(self, path, flags):
        return os.open(self._p(path), flags)

    def create(self, path, mode, fi=None):
        return os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

    def read(self, path, length, offset, fh):
        os.lseek(fh, offset, os.SEEK_SET)
        return os.read(fh, length)

    def write(self, path, buf, offset, fh):
        os.lseek(fh, offset, os.SEEK_SET)
        return os.write(fh, buf)

    def truncate(self, path, length, fh=None):
        with open(self._p(path), "r+") as f:
            f.truncate(length)

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        return os.close(fh)

    def fsync(self, path, datasync, fh):
        self._sleep()
        return os.fdatasync(fh) if datasync else os.fsync(fh)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backing")
    ap.add_argument("mountpoint")
    ap.add_argument("--sync-ms", type=float, default=20.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    a = ap.parse_args()
    os.makedirs(a.backing, exist_ok=True)
    os.makedirs(a.mountpoint, exist_ok=True)
    FUSE(SlowSync(a.backing, a.sync_ms / 1e3, a.jitter_ms / 1e3), a.mountpoint,
         foreground=True, nothreads=False, allow_other=True)


if __name__ == "__main__":
    main()
