#!/usr/bin/env python3
"""A tenant that undoes every SIGSTOP sent to its own child, with ptrace.

Usage: ptrace_parent.py PROGRAM [ARG...]

Forks PROGRAM as its child (which dies with this process), attaches to it with
PTRACE_SEIZE (allowed at every Yama ptrace_scope but 3: the tracee is a descendant),
follows its threads, and continues every signal-delivery stop of SIGSTOP, SIGTSTP,
SIGTTIN and SIGTTOU with the signal suppressed: a SIGSTOP from anyone else never stops
it. Every other signal is passed on. Prints the child's PID on the first line of stdout.
What cannot be undone this way: the cgroup freezer.
"""
import ctypes
import os
import signal
import sys

PTRACE_CONT = 7
PTRACE_SETOPTIONS = 0x4200
PTRACE_SEIZE = 0x4206
PTRACE_O_TRACECLONE = 0x8
PTRACE_EVENT_STOP = 128
PR_SET_PDEATHSIG = 1
WALL = 0x40000000

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace.restype = ctypes.c_long
STOPS = {signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}


def ptrace(req, pid, addr=0, data=0):
    if libc.ptrace(req, pid, ctypes.c_void_p(addr), ctypes.c_void_p(data)) == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({req:#x}, {pid}): {os.strerror(err)}")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.close(w)
        os.read(r, 1)  # wait until attached
        os.execvp(sys.argv[1], sys.argv[1:])
    os.close(r)
    ptrace(PTRACE_SEIZE, child, 0, PTRACE_O_TRACECLONE)
    os.write(w, b"x")
    os.close(w)
    print(child, flush=True)
    while True:
        try:
            tid, status = os.waitpid(-1, WALL)
        except ChildProcessError:
            return
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            if tid == child:
                return
            continue
        if not os.WIFSTOPPED(status):
            continue
        sig = os.WSTOPSIG(status)
        event = status >> 16
        # A new thread, a group stop (PTRACE_EVENT_STOP), or a signal: continue it; a
        # stopping signal is dropped.
        deliver = 0 if (event or sig in STOPS or sig == signal.SIGTRAP) else sig
        try:
            ptrace(PTRACE_CONT, tid, 0, deliver)
        except OSError:
            pass  # the thread exited meanwhile


if __name__ == "__main__":
    main()
