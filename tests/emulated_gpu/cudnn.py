"""The emulated cuDNN frontend (the ``cudnn`` module of
nvidia-cudnn-frontend, its ``pygraph`` API as gpu/cudnn.py and
gpu/cudnn_tune.py use it): graphs record their operations; an execution
runs with NumPy on the host addresses of the variant pack.

As the real one on a stream: ``set_stream`` binds a handle to a stream, and
``execute``/``execute_plan_at_index`` are device work on that stream
(``capture.device_work``): queued, or recorded into a capture, reading its
inputs when it runs (at each replay). During a capture it refuses what the
real one cannot do there: building plans (``create_execution_plans``,
``check_support``, ``build_plans``, ``build_plan_at_index`` allocate and
synchronise); timing a plan needs timing events and a synchronisation,
which the capture itself refuses (``device.py``)."""
import ctypes
import types

import numpy as np

from . import capture
from .helpers import run_kernel
from .host_kernels import tf32_round

#: what the emulated frontend says when a plan is built inside a capture
BUILD_REFUSED = ("cudnn: building an execution plan during a stream capture (it allocates "
                 "and synchronises the device)")


def from_address(ptr, shape, dtype):
    count = int(np.prod(shape))
    raw = (ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


#: the simulated GPU's clock (ms): a plan's execution advances it by its cost,
#: CUDA events read it (``cupy.cuda.Event.record`` / ``get_elapsed_time``)
GPU_CLOCK = {"ms": 0.0}

#: the stand-in's engines, in the heuristics' order: (name, cost in ms,
#: workspace bytes, numerical notes, builds[, relative error]). The
#: heuristic's first is not the fastest; the fastest overall does not build;
#: an FFT engine with a filter flip is the fastest accurate deterministic
#: float32 one. The last is faster still and inaccurate, with no numerical
#: note to deselect it by: on an H200 (cuDNN 9.19) the weight-gradient
#: engine eng17_k25=0 was the fastest of cifar10_quick's conv2 and off by
#: 2e-3 to 6e-3 of the largest value (the others by 2e-7 to 7e-6).
ENGINES = [("eng0_implicit_gemm", 5.0, 1024, (), True),
           ("eng1_fft_flip_filter", 2.0, 8192, (), True),
           ("eng2_winograd", 3.0, 2048, (), True),
           ("eng3_atomics", 1.0, 512, ("NONDETERMINISTIC",), True),
           ("eng4_no_build", 0.5, 0, (), False),
           ("eng5_tensor_core", 0.8, 256, ("TENSOR_CORE",), True),
           ("eng6_winograd_nonfused", 1.5, 4096, (), True, 5e-3)]


class FakeCudnn(types.ModuleType):
    """Records graph building; executes on host addresses with NumPy.

    Mirrors the frontend's Python API (cudnn.pygraph): heuristics list the
    plans of ``engines`` (``create_execution_plans``), ``deselect_numeric_notes``
    drops the plans with those notes, ``build_plans(policy)`` builds the first
    plan that builds (``HEURISTICS_CHOICE``, the default) or every one that
    builds (``ALL``; raises when none does), ``build_plan_at_index``,
    ``get_execution_plan_count``, ``get_plan_name_at_index``,
    ``get_workspace_size_plan_at_index`` (a built plan's; raises otherwise),
    ``get_workspace_size`` (the heuristic choice's), ``execute`` (the
    heuristic choice) and ``execute_plan_at_index`` (a built plan; raises
    otherwise). Each execution advances ``GPU_CLOCK`` by its plan's cost;
    a plan with the ``TENSOR_CORE`` note reads its X, W, DY rounded to TF32
    (``math``: which runs did)."""

    def __init__(self, unsupported=(), engines=ENGINES, version=91900):
        super().__init__("cudnn")
        self.data_type = types.SimpleNamespace(FLOAT="float32", BFLOAT16="bfloat16",
                                               HALF="float16", INT64="int64")
        self.diagonal_alignment = types.SimpleNamespace(TOP_LEFT="TOP_LEFT",
                                                        BOTTOM_RIGHT="BOTTOM_RIGHT")
        self.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
        self.numerical_note = types.SimpleNamespace(NONDETERMINISTIC="NONDETERMINISTIC",
                                                    TENSOR_CORE="TENSOR_CORE")
        self.build_plan_policy = types.SimpleNamespace(HEURISTICS_CHOICE="HEURISTICS_CHOICE",
                                                       ALL="ALL")
        self.unsupported = set(unsupported)   # op names whose graphs have no plan
        self.sdpa_max_head = 128   # Ampere's backward bound (Hopper: 256)
        self.engines, self.version = list(engines), version
        self.graphs, self.streams, self.executed = [], [], []
        self.math = []   # (graph, whether its plan ran on TF32 tensor cores) of each run
        outer = self

        class Tensor:
            def __init__(self, name, dim=None, stride=None, data_type=None, op=None):
                self.name, self.dim, self.stride, self.op = name, dim, stride, op
                self.data_type = data_type or "float32"
                self.output = False

            def set_output(self, flag):
                self.output = flag
                return self

            def set_dim(self, dim):
                self.dim = list(dim)
                return self

            def set_stride(self, stride):
                self.stride = list(stride)
                return self

            def set_data_type(self, data_type):
                self.data_type = data_type
                return self

        class PyGraph:
            def __init__(self, io_data_type, intermediate_data_type, compute_data_type, handle):
                self.calls, self.ops, self.notes = [], [], []
                self.plans, self.built = [], set()
                outer.graphs.append(self)

            def tensor(self, name, dim, stride, data_type):
                return Tensor(name, dim, stride, data_type)

            def _op(self, kind, **kw):
                self.ops.append((kind, kw))
                return Tensor(kind, op=(kind, kw))

            def conv_fprop(self, image, weight, padding, stride, dilation):
                return self._op("conv_fprop", x=image, w=weight, padding=padding, stride=stride,
                                dilation=dilation)

            def conv_dgrad(self, loss, filter, padding, stride, dilation):
                return self._op("conv_dgrad", dy=loss, w=filter, padding=padding,
                                stride=stride, dilation=dilation)

            def conv_wgrad(self, image, loss, padding, stride, dilation):
                return self._op("conv_wgrad", x=image, dy=loss, padding=padding,
                                stride=stride, dilation=dilation)

            def bias(self, name, input, bias):
                return self._op("bias", input=input, bias=bias)

            def relu(self, name, input):
                return self._op("relu", input=input, slope=0.0)

            def leaky_relu(self, name, input, negative_slope):
                return self._op("relu", input=input, slope=negative_slope)

            def relu_backward(self, loss, input, name=""):
                return self._op("relu_backward", loss=loss, input=input, slope=0.0)

            def leaky_relu_backward(self, loss, input, negative_slope, name=""):
                return self._op("relu_backward", loss=loss, input=input, slope=negative_slope)

            def sdpa(self, q, k, v, attn_scale=None, generate_stats=None,
                     diagonal_alignment="TOP_LEFT", diagonal_band_right_bound=None,
                     dropout=None, name=""):
                """[O, stats] (the real one's signature, the arguments used here)."""
                kw = dict(q=q, k=k, v=v, scale=attn_scale, causal=diagonal_band_right_bound == 0,
                          align=diagonal_alignment, dropout=dropout, stats=bool(generate_stats))
                self.ops.append(("sdpa", kw))
                return [Tensor("O", op=("sdpa", kw)), Tensor("Stats", op=("sdpa", kw))]

            def sdpa_backward(self, q, k, v, o, dO, stats, attn_scale=None,
                              diagonal_alignment="TOP_LEFT", diagonal_band_right_bound=None,
                              dropout=None, use_deterministic_algorithm=False, name=""):
                kw = dict(q=q, k=k, v=v, o=o, do=dO, stats=stats, scale=attn_scale,
                          causal=diagonal_band_right_bound == 0, align=diagonal_alignment,
                          dropout=dropout, deterministic=use_deterministic_algorithm)
                self.ops.append(("sdpa_backward", kw))
                return [Tensor(n, op=("sdpa_backward", kw)) for n in ("dQ", "dK", "dV")]

            def validate(self):
                self.calls.append("validate")

            def build_operation_graph(self):
                self.calls.append("build_operation_graph")

            def create_execution_plans(self, modes):
                _refuse_in_capture("create_execution_plans")
                self.calls.append(("create_execution_plans", tuple(modes)))
                self.plans = list(outer.engines)

            def deselect_numeric_notes(self, notes):
                self.notes = list(notes)
                self.plans = [p for p in self.plans if not set(p[3]) & set(notes)]

            def check_support(self):
                _refuse_in_capture("check_support")
                self.calls.append("check_support")
                kinds = {k for k, _ in self.ops}
                for kind, kw in self.ops:   # cuDNN's SDPA support surface (Attention.md)
                    if kind.startswith("sdpa"):
                        d = kw["q"].dim[3]
                        if d % 8 or d > outer.sdpa_max_head:
                            raise RuntimeError(f"cudnn: SDPA head dim {d} unsupported (a "
                                               f"multiple of 8, at most {outer.sdpa_max_head})")
                if kinds & outer.unsupported or not self.plans:
                    raise RuntimeError(f"no plan for {sorted(kinds & outer.unsupported)}")

            def build_plans(self, policy="HEURISTICS_CHOICE"):
                _refuse_in_capture("build_plans")
                self.calls.append(("build_plans", policy))
                for i, plan in enumerate(self.plans):
                    if plan[4]:
                        self.built.add(i)
                        if policy == "HEURISTICS_CHOICE":
                            break
                if not self.built:
                    raise RuntimeError("no plan builds")

            def build_plan_at_index(self, index):
                _refuse_in_capture("build_plan_at_index")
                self.calls.append(("build_plan_at_index", index))
                if not self.plans[index][4]:
                    raise RuntimeError(f"plan {index} does not build")
                self.built.add(index)

            def get_execution_plan_count(self):
                return len(self.plans)

            def get_plan_name_at_index(self, index):
                return self.plans[index][0]

            def get_workspace_size_plan_at_index(self, index):
                if index not in self.built:
                    raise RuntimeError(f"plan {index} is not built")
                return self.plans[index][2]

            def _candidate(self):
                return min(self.built)

            def get_workspace_size(self):
                return self.plans[self._candidate()][2]

            def execute(self, pack, workspace, handle):
                self.execute_plan_at_index(pack, workspace, self._candidate(), handle)

            def execute_plan_at_index(self, pack, workspace, index, handle=None):
                assert isinstance(workspace, int) and all(isinstance(p, int)
                                                          for p in pack.values())
                if index not in self.built:
                    raise RuntimeError(f"plan {index} is not built")
                stream = capture.stream_of(getattr(handle, "stream", 0) or 0)
                cost = self.plans[index][1]

                tensor_core = "TENSOR_CORE" in self.plans[index][3]

                def run():   # device work: reads the pack's memory when it runs
                    outer.executed.append((self, workspace, index))
                    outer.math.append((self, tensor_core))
                    GPU_CLOCK["ms"] += cost
                    if stream is not None:
                        stream.device.busy_ms += cost
                    if self.ops and self.ops[0][0].startswith("sdpa"):
                        sdpa_execute(self, pack)
                        return
                    arrays = {t: from_address(p, t.dim, np.float32) for t, p in pack.items()
                              if t.op is None or t.output}
                    if tensor_core:   # TF32 tensor cores read the product's operands in TF32
                        arrays.update({t: tf32_round(a) for t, a in arrays.items()
                                       if t.op is None and t.name in ("X", "W", "DY")})
                    (out,) = [t for t in pack if t.output]
                    value = self._value(out, arrays)
                    error = self.plans[index][5] if len(self.plans[index]) > 5 else 0.0
                    if error:   # a fixed pattern of that size, relative to the largest value
                        pattern = np.sin(np.arange(value.size, dtype=np.float64)).reshape(
                            value.shape)
                        value = value + error * float(np.abs(value).max()) * pattern
                    arrays[out][...] = value

                capture.device_work(run, stream)

            def _value(self, t, arrays):
                if t.op is None:
                    return arrays[t]
                kind, kw = t.op
                geo = {"pad": kw.get("padding"), "stride": kw.get("stride"),
                       "dilation": kw.get("dilation")}
                if kind == "conv_fprop":
                    x, w = self._value(kw["x"], arrays), self._value(kw["w"], arrays)
                    return run_kernel("Conv", geo, [x, w])[0]
                if kind == "conv_dgrad":
                    dy, w = self._value(kw["dy"], arrays), self._value(kw["w"], arrays)
                    return run_kernel("ConvGradData", dict(geo, x_shape=t.dim), [dy, w])[0]
                if kind == "conv_wgrad":
                    x, dy = self._value(kw["x"], arrays), self._value(kw["dy"], arrays)
                    return run_kernel("ConvGradWeight", dict(geo, w_shape=t.dim), [dy, x])[0]
                if kind == "bias":
                    return self._value(kw["input"], arrays) + self._value(kw["bias"], arrays)
                if kind == "relu_backward":   # dy where the mask passed, else dy * slope
                    dy, m = self._value(kw["loss"], arrays), self._value(kw["input"], arrays)
                    return np.where(m > 0, dy, dy * np.float32(kw["slope"]))
                if kind == "relu":
                    v = self._value(kw["input"], arrays)
                    return np.where(v > 0, v, v * np.float32(kw["slope"])) if kw["slope"] \
                        else np.maximum(v, 0)
                raise AssertionError(kind)

        self.pygraph = PyGraph

    def backend_version(self):
        return self.version

    def create_handle(self):
        return types.SimpleNamespace(stream=0)

    def set_stream(self, handle, stream):
        handle.stream = int(stream)
        self.streams.append(stream)


def _refuse_in_capture(what):
    if capture.is_capturing():
        raise RuntimeError(f"{BUILD_REFUSED}: {what}")


# ---------------------------------------------------------------- SDPA
def strided(ptr, dim, stride, data_type):
    """The host memory at ``ptr`` as an array of ``dim`` with element
    ``stride``, in the storage of ``data_type`` (bfloat16: uint16)."""
    storage = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32,
               "int64": np.int64}[data_type]
    span = 1 + sum((int(d) - 1) * int(s) for d, s in zip(dim, stride))
    base = from_address(ptr, (span,), storage)
    item = np.dtype(storage).itemsize
    return np.lib.stride_tricks.as_strided(base, tuple(dim),
                                           tuple(int(s) * item for s in stride))


def decode(x, data_type):
    """float32 values of 16-bit storage (bfloat16: the upper half)."""
    if data_type == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def encode(x, data_type):
    """16-bit storage of float32 values, rounded to nearest even."""
    from purine_mpi.base.precision import round_to, scratch_spec
    x = np.array(x, dtype=np.float32)
    if data_type == "bfloat16":
        shape, dt = scratch_spec(x.shape, "bfloat16")
        round_to(x, "bfloat16", np.empty(shape, dt))
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(np.float16)


def sdpa_reference(q, k, v, scale, causal, data_type, dropout=None):
    """cuDNN's SDPA forward on float32 values of ``data_type`` (B, H, T, D):
    S = scale q k^T in float32, -inf where j > i (top-left causal), stats =
    max + ln sum exp(S - max), P = exp(S - stats) rounded to the io type for
    the second product (FlashAttention-2 feeds P to it in the io type), then
    dropout (mask / (1 - p)), O = P v accumulated in float32 and rounded."""
    s = np.einsum("bhid,bhjd->bhij", q, k, dtype=np.float32) * np.float32(scale)
    if causal:
        t = s.shape[-1]
        s = np.where(np.triu(np.ones((t, t), bool), 1), np.float32(-np.inf), s)
    m = s.max(axis=-1, keepdims=True)
    stats = m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True))
    p = np.exp(s - stats)
    if dropout is not None:
        p = p * dropout
    p16 = decode(encode(p, data_type), data_type)
    o = np.einsum("bhij,bhjd->bhid", p16, v, dtype=np.float32)
    return o.astype(np.float32), stats.astype(np.float32), p


def sdpa_backward_reference(q, k, v, o, do, stats, scale, causal, data_type, dropout=None):
    """cuDNN's SDPA backward from the forward's stats: P = exp(S - stats)
    (S recomputed, masked), D = rowsum(dO * O), dP = dO v^T (times the
    dropout mask / (1 - p)), dS = P (dP - D), dq = scale dS k,
    dk = scale dS^T q, dv = (P with dropout)^T dO, in float32."""
    s = np.einsum("bhid,bhjd->bhij", q, k, dtype=np.float32) * np.float32(scale)
    if causal:
        t = s.shape[-1]
        s = np.where(np.triu(np.ones((t, t), bool), 1), np.float32(-np.inf), s)
    p = np.exp(s - stats)
    pd = p if dropout is None else p * dropout
    dv = np.einsum("bhij,bhid->bhjd", decode(encode(pd, data_type), data_type), do)
    dp = np.einsum("bhid,bhjd->bhij", do, v, dtype=np.float32)
    if dropout is not None:
        dp = dp * dropout
    delta = (do * o).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = np.einsum("bhij,bhjd->bhid", ds, k) * np.float32(scale)
    dk = np.einsum("bhij,bhid->bhjd", ds, q) * np.float32(scale)
    return dq.astype(np.float32), dk.astype(np.float32), dv.astype(np.float32)


def dropout_mask(shape, ratio, seed, offset):
    """The emulation's keep-mask scaled by 1/(1 - p): drawn from our Philox
    (base/philox.py) keyed by the seed and counted by the offset. A
    stand-in: the real one's bits are cuDNN's Philox mapping; what is
    emulated is that the forward and the backward of one (seed, offset)
    draw the same mask and another offset another one."""
    from purine_mpi.base.philox import keep_mask
    seed = int(seed)
    keep = keep_mask(shape, ratio, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, 0,
                     int(offset))
    return keep.astype(np.float32) / np.float32(1.0 - ratio)


def sdpa_execute(graph, pack):
    """Run an SDPA forward or backward graph on the pack's host memory."""
    kind, kw = graph.ops[0]
    by_name = {t.name: (t, p) for t, p in pack.items()}
    view = {}
    for t, p in pack.items():
        view[t.name] = strided(p, t.dim, t.stride, t.data_type)
    io = kw["q"].data_type

    def value(t):
        return decode(view[t.name], io)

    q, k, v = value(kw["q"]), value(kw["k"]), value(kw["v"])
    mask = None
    if kw["dropout"] is not None:
        ratio, seed_t, offset_t = kw["dropout"]
        mask = dropout_mask(q.shape[:3] + (k.shape[2],), ratio,
                            view[seed_t.name].reshape(-1)[0], view[offset_t.name].reshape(-1)[0])
    if kind == "sdpa":
        o, stats, _ = sdpa_reference(q, k, v, kw["scale"], kw["causal"], io, mask)
        view["O"][...] = encode(o, io)
        if "Stats" in by_name:
            view["Stats"][...] = stats
        return
    o, do = value(kw["o"]), value(kw["do"])
    stats = view[kw["stats"].name].astype(np.float32)
    grads = sdpa_backward_reference(q, k, v, o, do, stats, kw["scale"], kw["causal"], io, mask)
    for name, g in zip(("dQ", "dK", "dV"), grads):
        view[name][...] = encode(g, io)
