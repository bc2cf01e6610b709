"""Convolution through NVIDIA's cuDNN frontend (``nvidia-cudnn-frontend``,
the ``cudnn`` Python module of the ``gpu`` extra), with automatic fallback.

Each Conv / ConvGradData / ConvGradWeight op on a GPU builds, in its
``setup`` (once per shape, before the first iteration), a cuDNN graph:

    fprop   Y = conv_fprop(X, W) [-> bias(B) -> relu / leaky_relu]   (a fused
            ReLU, parallel/fuse.py, and the bias go into cuDNN's epilogue when it
            offers that fusion; else conv_fprop alone and our bias_act kernel)
    dgrad   DX = conv_dgrad(DY, W) [-> relu_backward(., M)]   (the ReLU mask of
            the layer below, fused by parallel/fuse.py: dgrad + drelu where
            cuDNN has a plan; else dgrad alone and our relu_backward kernel)
    wgrad   DW = conv_wgrad(X, DY)

in NCHW float32 (``float64`` and grouped convolutions take the fallback),
with plans from heuristics A then FALLBACK, keeping only deterministic plans
(``numerical_note.NONDETERMINISTIC`` deselected: a resume stays bit-exact;
``PURINE_CUDNN_DETERMINISTIC=0`` lifts it) and, unless ``tf32: true`` or the
op is marked bf16/fp16 (its operands exact in TF32), no tensor-core plans
(``TENSOR_CORE``: float32 stays float32, as on the CPU).
Of those, the fastest on the op's buffers is taken, timed once and cached on
disk (gpu/cudnn_tune.py; ``PURINE_CUDNN_BENCHMARK=0``: the heuristic's first
plan). The chosen plan's workspace is part of the op's
scratch (``Workspace.scratch_for``), reserved at setup. At run time the op
binds the stream CuPy has current to a per-thread handle and executes the
graph on raw device pointers (the frontend's ``{tensor: int}`` variant pack).

When the ``cudnn`` module or the cuDNN library is missing, or a graph has no
supported plan, the op keeps the im2col + cuBLAS path (gpu/conv.py). The
first time, one line on standard error says so and why. ``PURINE_CONV``
chooses: ``auto`` (default), ``im2col`` (never cuDNN), ``cudnn`` (cuDNN where
it can; the same fallback otherwise, also said once).

Nothing here imports ``cudnn`` or CuPy at import time.
"""
import threading
import time

import numpy as np

from ..base import env
from . import SaidOnce
from . import cudnn_tune as tune

_lock = threading.Lock()
_state = {"checked": False, "module": None, "reason": None}
_say_once = SaidOnce()
_handles = {}   # (device, thread id) -> cudnn handle


def mode():
    """``PURINE_CONV``: auto, cudnn or im2col."""
    return env.get("PURINE_CONV")  # EnvError when not one of them


def frontend():
    """The ``cudnn`` frontend module when it and the cuDNN library load (and
    ``PURINE_CONV`` allows it), else None; the reason is kept for the log."""
    with _lock:
        if _state["checked"]:
            return _state["module"]
        _state["checked"] = True
    module, reason = None, None
    if mode() == "im2col":
        reason = "PURINE_CONV=im2col"
    else:
        try:
            import cudnn as module  # nvidia-cudnn-frontend
            probe = getattr(module, "backend_version", None) or \
                getattr(module, "backend_version_string")
            version = probe()  # loads libcudnn: fails without it
            if not version:
                raise RuntimeError("cuDNN reports no backend version")
        except ImportError as exc:
            module = None
            reason = (f"no cuDNN frontend: {str(exc).splitlines()[0] if str(exc) else exc!r}; "
                      "it comes with pip install 'purine_mpi[gpu]' (nvidia-cudnn-frontend)")
        except Exception as exc:  # OSError (no libcudnn), a broken install, ...
            module = None
            reason = f"cuDNN unusable: {type(exc).__name__}: {exc}".splitlines()[0]
    with _lock:
        _state["module"], _state["reason"] = module, reason
    return module


def fallback_reason():
    """Why the cuDNN path is off ('' when it is on)."""
    frontend()
    return _state["reason"] or ""


def note_fallback(what, reason):
    """Say once per reason that convolutions use im2col + cuBLAS."""
    _say_once(("fallback", reason), f"purine_mpi: {what} use im2col + cuBLAS, not cuDNN "
                                    f"({reason})")


def reset():
    """Forget the availability check and the notes (tests)."""
    with _lock:
        _state.update(checked=False, module=None, reason=None)
        _say_once.clear()
        _handles.clear()


def _handle(cudnn, device):
    """This host thread's cuDNN handle on ``device`` (handles bind a stream:
    one per thread, so two streams never share one)."""
    key = (int(device), threading.get_ident())
    handle = _handles.get(key)
    if handle is None:
        handle = cudnn.create_handle()
        with _lock:
            _handles[key] = handle
    return handle


def _capturing():
    """Whether CuPy's current stream is capturing (no timing inside a capture)."""
    from . import import_cupy
    cupy = import_cupy()
    try:
        return bool(cupy.cuda.runtime.streamIsCapturing(cupy.cuda.get_current_stream().ptr))
    except Exception:
        return False


def _strides(shape):
    """NCHW (C-contiguous) strides of ``shape``, in elements."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= int(size)
    return list(reversed(strides))


class ConvPlan:
    """One cuDNN graph of a convolution direction, built for fixed shapes.

    ``kind``: "fprop" (inputs x, w[, b]; output y), "dgrad" (dy, w -> dx),
    "wgrad" (x, dy -> dw). ``geo``: ops/conv.py's geometry. ``bias`` and
    ``relu`` (fprop only) fuse the epilogue; ``fused`` tells whether they
    are in the graph. Raises when the graph has no plan (the caller falls
    back)."""

    def __init__(self, cudnn, device, kind, geo, dtype, bias=False, relu=False, slope=0.0,
                 tf32=False, buffers=None, values=None):
        self.cudnn, self.device, self.kind = cudnn, int(device), kind
        self.tf32, self.values = bool(tf32), values
        if np.dtype(dtype) != np.dtype(np.float32):
            raise TypeError(f"cuDNN path: float32 only, got {np.dtype(dtype)}")
        if geo["G"] != 1:
            raise ValueError("cuDNN path: grouped convolutions take the im2col path")
        x_shape = [geo["N"], geo["C"], geo["H"], geo["W"]]
        w_shape = [geo["O"], geo["C"], geo["kh"], geo["kw"]]
        y_shape = [geo["N"], geo["O"], geo["OH"], geo["OW"]]
        conv = {"padding": [geo["ph"], geo["pw"]], "stride": [geo["sh"], geo["sw"]],
                "dilation": [geo["dh"], geo["dw"]]}
        f32 = cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32,
                              compute_data_type=f32, handle=_handle(cudnn, device))

        def tensor(name, shape):
            return graph.tensor(name=name, dim=list(shape), stride=_strides(shape),
                                data_type=f32)

        def output(out, shape):
            out.set_output(True).set_dim(shape).set_stride(_strides(shape)).set_data_type(f32)

        self.tensors = {}
        self.shapes = {"y": y_shape, "dx": x_shape, "dw": w_shape}   # outputs
        self.fused = False
        if kind == "fprop":
            X, W = tensor("X", x_shape), tensor("W", w_shape)
            out = graph.conv_fprop(image=X, weight=W, **conv)
            self.tensors.update(x=X, w=W)
            if bias:
                B = tensor("B", [1, geo["O"], 1, 1])
                out = graph.bias(name="bias", input=out, bias=B)
                self.tensors["b"] = B
            if relu:
                out = (graph.leaky_relu(name="relu", input=out, negative_slope=float(slope))
                       if slope else graph.relu(name="relu", input=out))
            self.fused = bool(bias or relu)
            output(out, y_shape)
            self.tensors["y"] = out
        elif kind == "dgrad":
            DY, W = tensor("DY", y_shape), tensor("W", w_shape)
            out = graph.conv_dgrad(loss=DY, filter=W, **conv)
            self.tensors.update(dy=DY, w=W)
            if relu:   # the ReLU mask of the layer below: dgrad + drelu in one graph
                # (a strided dgrad's output dims are ambiguous: given, as for an output)
                out.set_dim(x_shape).set_stride(_strides(x_shape)).set_data_type(f32)
                M = self.tensors["m"] = tensor("M", x_shape)
                out = (graph.leaky_relu_backward(loss=out, input=M, negative_slope=float(slope))
                       if slope else graph.relu_backward(loss=out, input=M))
                self.fused = True
            output(out, x_shape)
            self.tensors["dx"] = out
        elif kind == "wgrad":
            X, DY = tensor("X", x_shape), tensor("DY", y_shape)
            out = graph.conv_wgrad(image=X, loss=DY, **conv)
            output(out, w_shape)
            self.tensors.update(x=X, dy=DY, dw=out)
        else:
            raise ValueError(f"unknown convolution direction {kind!r}")
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        determ = tune.deterministic()
        notes = [cudnn.numerical_note.NONDETERMINISTIC] if determ else []  # bit-exact resumes
        if not tf32:
            notes.append(cudnn.numerical_note.TENSOR_CORE)  # float32 math stays float32
        if notes:
            graph.deselect_numeric_notes(notes)
        graph.check_support()
        self.graph = graph
        self.index = None   # None: the heuristic's plan (graph.execute)
        key = tune.plan_key(kind, geo, dtype, bias, relu, slope, determ, tf32, values)
        if buffers is None or not tune.benchmark_enabled() or _capturing():
            graph.build_plans()
            self.workspace_bytes = int(graph.get_workspace_size())
            tune.note("heuristic")
            tune.note_choice(self.workspace_bytes)
            return
        self._choose(key, buffers)

    def _choose(self, key, buffers):
        """Take the plan the cache names for ``key``, else time them all on
        ``buffers`` (inputs: the op's arrays; outputs: temporaries) and
        remember the fastest (gpu/cudnn_tune.py)."""
        from . import import_cupy
        cupy = import_cupy()
        graph = self.graph
        version = int(self.cudnn.backend_version())
        gpu_name = tune.device_name(cupy, self.device)
        path = tune.cache_path(gpu_name, version)
        entry = tune.load(path, gpu_name, version).get(key)
        index = tune.cached_index(graph, entry) if isinstance(entry, dict) else None
        if index is not None:
            self.index = index
            self.workspace_bytes = int(graph.get_workspace_size_plan_at_index(index))
            tune.note("cached", path=path)
            self._noted(entry)
            return
        t0 = time.perf_counter()
        graph.build_plans(self.cudnn.build_plan_policy.ALL)
        arrays = dict(buffers)
        keep = []
        for name, t in self.tensors.items():
            if name not in arrays:   # an output: a temporary, the op's blobs stay as they are
                arrays[name] = cupy.empty(tuple(self.shapes[name]), dtype=np.float32)
                keep.append(arrays[name])
        from .raw import data_ptr
        pack = {self.tensors[k]: data_ptr(a) for k, a in arrays.items()}
        handle = _handle(self.cudnn, self.device)
        self.cudnn.set_stream(handle=handle, stream=cupy.cuda.get_current_stream().ptr)
        out_key = next(k for k in self.shapes if k in self.tensors)
        # TF32 plans are checked too where the inputs hold bf16/fp16 values
        # (on them TF32 is exact)
        tol = tune.ACCURACY_TOL if self.values or not self.tf32 else None
        check_pack = None
        if tol is not None:
            # the accuracy check reads inputs of varied values: at set-up the
            # op's own buffers hold zeros or stale values, on which every plan
            # agrees (so an H200's inaccurate weight-gradient engine was kept);
            # rounded to bf16/fp16 as the op's inputs are when it runs
            rng = np.random.default_rng(0)
            probes = {k: cupy.asarray(rng.standard_normal(tuple(a.shape)).astype(np.float32))
                      for k, a in buffers.items()}
            if self.values:
                from .kernels import round_in_place
                probes = {k: round_in_place(a, self.values) for k, a in probes.items()}
            keep.extend(probes.values())
            check_pack = dict(pack)
            check_pack.update({self.tensors[k]: data_ptr(a) for k, a in probes.items()})
        best = tune.time_plans(graph, pack, handle, cupy, output=arrays[out_key], tol=tol,
                               check_pack=check_pack)
        if best is None:
            raise RuntimeError("no cuDNN plan ran")
        self.index = best["index"]
        self.workspace_bytes = int(best["workspace"])
        tune.store(path, gpu_name, version, key, best)
        tune.note("timed", time.perf_counter() - t0, path=path)
        self._noted(best)

    def _noted(self, entry):
        """Count the chosen plan's workspace and the time given up to the cap;
        say once when no plan fitted it."""
        over = bool(entry.get("over_cap"))
        tune.note_choice(self.workspace_bytes, entry.get("ms"), entry.get("fastest_ms"), over)
        if over:
            _say_once(("over_cap",), f"purine_mpi: no cuDNN plan of some convolutions fits "
                                     f"gpu.workspace_limit ({tune.workspace_limit()} bytes): "
                                     "the plan with the smallest workspace is taken")

    def execute(self, arrays, workspace):
        """Run on ``arrays`` ({"x": ..., "w": ..., ...}: CuPy arrays, keys as
        in ``tensors``) with ``workspace`` (a uint8 device array of at least
        ``workspace_bytes``), on CuPy's current stream."""
        from . import import_cupy
        from .raw import data_ptr
        cupy = import_cupy()
        handle = _handle(self.cudnn, self.device)
        self.cudnn.set_stream(handle=handle, stream=cupy.cuda.get_current_stream().ptr)
        pack = {self.tensors[k]: data_ptr(a) for k, a in arrays.items()}
        if self.index is None:
            self.graph.execute(pack, data_ptr(workspace), handle=handle)
        else:
            self.graph.execute_plan_at_index(pack, data_ptr(workspace), index=self.index,
                                             handle=handle)


def expected_workspace(kind, geo, dtype, bias=False, relu=False, slope=0.0, values=None):
    """Before any plan is built (``plan`` counts the device's bytes): the
    workspace a convolution direction will take on the cuDNN path, as
    ``(bytes, source, entry)`` -- ``source`` "tuner cache" with the cached
    entry (its "ms" and "fastest_ms": the time given up to the cap) when a
    cache file of ``cudnn_tune`` holds its key (for whichever GPU wrote it:
    none is known here), else "gpu.workspace_limit cap" (the most a plan
    may take) -- or None: the op takes the im2col path (``PURINE_CONV``,
    no cuDNN, not float32, grouped)."""
    if np.dtype(dtype) != np.dtype(np.float32) or geo["G"] != 1 or frontend() is None:
        return None
    from . import tf32_enabled
    key = tune.plan_key(kind, geo, dtype, bias, relu, slope, tune.deterministic(),
                        tf32_enabled() or values is not None, values)
    entry = tune.cached_entry(key)
    if entry is not None:
        return int(entry["workspace"]), "tuner cache", entry
    return int(tune.workspace_limit()), "gpu.workspace_limit cap", None


def plan(kernel, kind, geo, dtype, device, buffers=None, values=None, **fusion):
    """A :class:`ConvPlan` for ``kernel``'s op, or None (the im2col path):
    cuDNN missing, the shape unsupported, or the op not float32/ungrouped.
    ``buffers``: the op's input arrays by tensor key ("x", "w", "b", "dy"),
    to time the plans on (gpu/cudnn_tune.py); None takes the heuristic's
    plan. ``values``: ``bfloat16``/``float16`` for an op marked so (its
    float32 operands hold those values, exact in TF32): TF32 plans are
    allowed whatever the process's ``tf32``. The first miss of each kind
    is said once."""
    cudnn = frontend()
    if cudnn is None:
        note_fallback("convolutions", fallback_reason())
        return None
    if np.dtype(dtype) != np.dtype(np.float32) or geo["G"] != 1:
        return None
    from . import tf32_enabled
    tf32 = tf32_enabled() or values is not None
    try:
        return ConvPlan(cudnn, device, kind, geo, dtype, tf32=tf32, buffers=buffers,
                        values=values, **fusion)
    except Exception as exc:
        if fusion.get("bias") or fusion.get("relu"):
            try:  # no fused plan: the convolution alone, our epilogue kernel after it
                plain = None if buffers is None else \
                    {k: v for k, v in buffers.items() if k not in ("b", "m")}
                return ConvPlan(cudnn, device, kind, geo, dtype, tf32=tf32,
                                buffers=plain, values=values)
            except Exception as plain_exc:
                exc = plain_exc
        note_fallback(f"some convolutions ({kind} of op '{kernel.op.name}')",
                      f"no cuDNN plan: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                      if str(exc) else f"no cuDNN plan: {type(exc).__name__}")
        return None
