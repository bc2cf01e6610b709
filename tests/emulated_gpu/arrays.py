"""The emulated device's arrays: ``DeviceArray`` (a NumPy array standing
for a CuPy array), the allocation log (``Allocations``) and the log of
CuPy's synchronous copies (``SYNC_COPIES``). Inside a capture they record
device work or refuse, as CuPy does (``capture.py``)."""
import threading
import weakref

import numpy as np

from . import capture


class NoDevice:
    """Stands for ``cupy.cuda.Device(...)``: a context manager doing nothing."""

    id = 0
    compute_capability = "90"

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def use(self):
        pass

    def synchronize(self):
        """``cudaDeviceSynchronize`` on the simulated device."""
        from .device import active_device
        active_device().synchronize()


class Allocations:
    """Device allocations on the emulated device, logged while ``counting``:
    every new DeviceArray that owns fresh memory -- a ufunc result without
    ``out=`` (``x > 0``, ``a @ b``, ``x.sum()``), a copy (``astype``,
    ``copy``, ``ascontiguousarray`` of a strided view), a NumPy function's
    result that shares no memory with its inputs (``where``, ``pad``), and
    the emulated cupy's ``empty``/``zeros``/``asarray``. What CuPy would
    allocate on a GPU for the same calls (its own internals aside)."""

    counting = False
    log = []
    #: bytes of every device allocation so far, counting or not (what the
    #: emulated memory pool says it holds: a pool that never reuses a block)
    total_bytes = 0
    #: the allocator the emulated ``cupy.cuda.set_allocator`` installed (None:
    #: the pool's own): called with each allocation's bytes after it is
    #: counted, as CuPy calls its allocator (gpu/memory.PeakMemory reads the
    #: pool's bytes in use there)
    allocator = None
    #: bytes of the device allocations still alive (the pool's ``used_bytes``:
    #: an allocation is given back when the array owning it is collected, as
    #: CuPy's pool takes a block back when its last array goes)
    in_use = 0
    _lock = threading.RLock()   # a finalizer may run inside ``note`` (a collection)

    @classmethod
    def note(cls, what, array):
        nbytes = int(getattr(array, "nbytes", 0))
        with cls._lock:
            cls.total_bytes += nbytes
            cls.in_use += nbytes
        weakref.finalize(array, cls._free, nbytes)
        if cls.allocator is not None:
            cls.allocator(nbytes)
        if cls.counting:
            cls.log.append((what, tuple(np.shape(array)), str(getattr(array, "dtype", ""))))

    @classmethod
    def _free(cls, nbytes):
        with cls._lock:
            cls.in_use -= nbytes


def plain(x):
    return np.asarray(x) if isinstance(x, DeviceArray) else x


def captured_value(x):
    """An operand of device work recorded in a capture: a device array is
    read when the work runs (replay); a host value is taken now, as CuPy
    passes host scalars to a kernel by value."""
    if isinstance(x, DeviceArray):
        return np.asarray(x)
    if isinstance(x, np.ndarray):
        return np.array(x, copy=True)
    if isinstance(x, (list, tuple)):
        return type(x)(captured_value(v) for v in x)
    return x


#: NumPy functions that return a view or a property, never new memory
_VIEW_FUNCTIONS = {"reshape", "ravel", "transpose", "swapaxes", "moveaxis", "squeeze",
                   "expand_dims", "broadcast_to", "atleast_1d", "atleast_2d", "atleast_3d",
                   "shape", "ndim", "size", "may_share_memory", "shares_memory",
                   "result_type", "iscomplexobj", "isrealobj"}


#: CuPy's synchronous copies (``ndarray.get``/``set``): (which, host thread)
SYNC_COPIES = []


class DeviceArray(np.ndarray):
    """A NumPy array standing for a CuPy array on the emulated device.

    On a stream that captures (``tests/capture.py``) it behaves as CuPy
    does there: device work (an elementwise operation into an existing
    array, a copy, a fill) is recorded into the graph, not run; a
    host<->device copy, a read of a value on the host and any allocation
    are refused, with CuPy's exceptions and messages."""

    @property
    def device(self):
        return NoDevice()

    def __array_finalize__(self, obj):
        if self.base is None:  # owns its memory: copy(), astype(), empty_like() ...
            Allocations.note("new array", self)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        capturing = capture.is_capturing()
        if capturing and (out is None or method == "at"):
            capture.refuse_allocation(f"{ufunc.__name__}.{method} without out=")
        if capturing and method == "reduce":
            # CuPy may run a reduction through CUB (CUPY_ACCELERATORS), whose
            # temporary storage comes from the pool: kept out of captures
            capture.refuse_allocation(f"{ufunc.__name__}.reduce (a CuPy reduction, "
                                          "which may take CUB temporary storage)")
        if capture.recording() and out is not None:  # device work of a launch
            args, outs = [captured_value(x) for x in inputs], tuple(plain(o) for o in out)
            frozen = {k: captured_value(v) for k, v in kwargs.items()}
            capture.device_work(
                lambda: getattr(ufunc, method)(*args, out=outs, **frozen))
            return out[0] if len(out) == 1 else out
        if out is not None:
            kwargs["out"] = tuple(plain(o) for o in out)
        result = getattr(ufunc, method)(*(plain(x) for x in inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        if method == "at":
            return None
        wrapped = []
        for r in result if isinstance(result, tuple) else (result,):
            owner = np.asarray(r)   # 0-d, as CuPy returns (a NumPy scalar: a new array)
            Allocations.note(f"{ufunc.__name__}.{method}", owner)
            wrapped.append(owner.view(DeviceArray))
        if capture.recording():  # a new array, computed when the launch's work runs
            args = [captured_value(x) for x in inputs]
            targets = tuple(np.asarray(w) for w in wrapped)
            capture.device_work(lambda: refill(
                targets, getattr(ufunc, method)(*args, **kwargs)))
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def __array_function__(self, func, types, args, kwargs):
        if func.__name__ not in _VIEW_FUNCTIONS and capture.recording():
            if func.__name__ == "copyto":
                dst, src = args[0], args[1] if len(args) > 1 else kwargs["src"]
                plain_dst, value = plain(dst), captured_value(src)
                capture.device_work(lambda: np.copyto(plain_dst, value))
                return None
            if kwargs.get("out") is not None:  # a kernel into an existing array
                out = kwargs["out"]
                plain_args = [captured_value(a) for a in args]
                plain_kwargs = {k: captured_value(v) for k, v in kwargs.items()}
                capture.device_work(lambda: func(*plain_args, **plain_kwargs))
                return out
            if capture.is_capturing():
                capture.refuse_allocation(f"numpy.{func.__name__} (not modelled as a "
                                              "capturable operation by the simulated device)")
        result = super().__array_function__(func, types, args, kwargs)
        inputs = [a for a in list(args) + list(kwargs.values()) if isinstance(a, np.ndarray)]
        fresh = []
        for r in result if isinstance(result, tuple) else (result,):
            if isinstance(r, np.ndarray) and r.size and \
                    not any(np.may_share_memory(r, a) for a in inputs):
                Allocations.note(func.__name__, r)
                fresh.append(r)
        if fresh and capture.recording():  # computed again when the work runs
            plain_args = [captured_value(a) for a in args]
            plain_kwargs = {k: captured_value(v) for k, v in kwargs.items()}
            targets = tuple(np.asarray(r) for r in fresh)
            capture.device_work(lambda: refill(
                targets, func(*plain_args, **plain_kwargs), fresh=True))
        return result

    def __setitem__(self, key, value):
        if capture.is_capturing() and isinstance(value, np.ndarray) and \
                not isinstance(value, DeviceArray):
            raise RuntimeError(capture.H2D_REFUSED)  # CuPy brings it over with set()
        if capture.recording():
            target, frozen = np.asarray(self), captured_value(value)
            capture.device_work(lambda: target.__setitem__(key, frozen))
            return
        super().__setitem__(key, value)

    def __getitem__(self, key):
        result = super().__getitem__(key)
        if not isinstance(result, np.ndarray):  # CuPy gives a 0-d device array
            result = super().__getitem__((key if isinstance(key, tuple) else (key,))
                                         + (Ellipsis,))
        return result

    def fill(self, value):
        self[...] = value

    def copy(self, order="C"):
        capture.refuse_allocation("ndarray.copy")
        return copied_on_device(self, super().copy(order))

    def astype(self, dtype, *args, **kwargs):
        result = super().astype(dtype, *args, **kwargs)
        if not np.may_share_memory(result, self):  # copy=False of the same dtype: self
            capture.refuse_allocation("ndarray.astype")
            result = copied_on_device(self, result)
        return result

    def set(self, array, stream=None):
        """CuPy's host -> device copy into this array."""
        capture.refuse_if_capturing(RuntimeError, capture.H2D_REFUSED,
                                        sim_stream(stream))
        SYNC_COPIES.append(("set", threading.current_thread().name))
        np.asarray(self)[...] = array

    def get(self, stream=None, out=None):
        """CuPy's device -> host copy: after the stream's queued work."""
        stream = sim_stream(stream)
        capture.refuse_if_capturing(RuntimeError, capture.D2H_REFUSED, stream)
        stream = stream or capture.current_stream()
        SYNC_COPIES.append(("get", threading.current_thread().name))
        if hasattr(stream, "synchronize") and not capture.recording():
            stream.synchronize()
        if out is None:
            return np.array(self)
        out[...] = self
        return out

    # a value read on the host is a device -> host copy (CuPy calls get())
    def __float__(self):
        return float(self.get())

    def __int__(self):
        return int(self.get())

    def __bool__(self):
        return bool(self.get())

    def item(self, *args):
        return self.get().item(*args)

    def tolist(self):
        return self.get().tolist()


def copied_on_device(source, copy):
    """A copy CuPy makes on the stream: within a launch it is device work,
    reading ``source`` when the stream gets to it (after the work queued
    before it), not when the host asks for it. (Made at once, it read the
    operand of an Eltwise sum before the GEMM writing it had run.)"""
    if capture.recording():
        src, target = np.asarray(source), np.asarray(copy)
        capture.device_work(lambda: np.copyto(target, src, casting="unsafe"))
    return copy


def refill(targets, result, fresh=False):
    """Write a recomputed result into the arrays handed out at launch."""
    results = result if isinstance(result, tuple) else (result,)
    if fresh:
        results = [r for r in results if isinstance(r, np.ndarray) and r.size]
    for target, value in zip(targets, results):
        target[...] = np.asarray(value)


def sim_stream(stream):
    """The simulated stream a CuPy ``stream=`` argument names (None: current)."""
    if stream is None:
        return None
    return capture.stream_of(stream.ptr) if hasattr(stream, "ptr") else stream
