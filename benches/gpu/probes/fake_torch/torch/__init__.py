"""A stand-in for PyTorch, for the harness's --sim run of tsg_train.py (no GPU): the
operations tsg_train.py uses, each a no-op, and a "CUDA context" that, like libcuda,
allocates an RM client, a device and two channel groups through ioctl(2) on the device
COLOC_TSG_CTL names (the fake RM device of tsg_fake_rm.c), so the preloaded hook sees them."""
import ctypes, os, struct, time

__version__ = "0-fake"
_ctx = []


def _iowr(nr, size):
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


def _context():
    if _ctx:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    fd = os.open(os.environ["COLOC_TSG_CTL"], os.O_RDWR)

    def alloc(fmt, *fields):
        buf = ctypes.create_string_buffer(struct.pack(fmt, *fields), struct.calcsize(fmt))
        if libc.ioctl(fd, _iowr(0x2B, len(buf.raw)), ctypes.addressof(buf)) != 0:
            raise OSError(ctypes.get_errno(), "fake CUDA: RM alloc failed")
        return struct.unpack(fmt, buf.raw)

    client = alloc("<IIIIQII", 0, 0, 0, 0x41, 0, 0, 0)[0]
    dev = alloc("<IIIIQQIIII", client, client, 0, 0x80, 0, 0, 0, 0, 0, 0)[2]
    for h in (0x5c000001, 0x5c000002):
        alloc("<IIIIQQIIII", client, dev, h, 0xA06C, 0, 0, 0, 0, 0, 0)
    _ctx.append(fd)


class device:
    def __init__(self, kind):
        self.kind = kind


class _T:
    def __init__(self, *_a, **_k):
        pass

    def square(self):
        return self

    def mean(self):
        return self

    def backward(self):
        time.sleep(0.001)

    def to(self, *_a):
        _context()
        return self

    def __call__(self, x):
        return x

    def parameters(self):
        return []


def randn(*_a, device=None):
    _context()
    return _T()


class nn:
    Linear = GELU = _T

    class Sequential(_T):
        pass


class optim:
    class SGD(_T):
        def step(self):
            pass

        def zero_grad(self):
            pass


class cuda:
    @staticmethod
    def synchronize():
        time.sleep(0.0005)
