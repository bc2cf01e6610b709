"""The emulated ``nvmath.bindings.cublasLt`` (nvmath-python 1.0's binding of
cuBLASLt, the functions and enums gpu/blaslt.py uses, with their
signatures and the enum values nvmath 1.0 has), doing the arithmetic with
NumPy on host memory addresses.

As cuBLASLt: attributes are set through a buffer of the attribute's own
type (``get_matmul_desc_attribute_dtype``; a size that is not the type's is
``INVALID_VALUE``), read from that buffer at the set; a matrix layout is
column-major (``ld >= rows``); ``matmul_algo_get_heuristic`` checks the
operation's types against the ``cublasLtMatmul()`` datatype table's rows
purine uses (cuBLAS docs, "Table 1": float32/float64 all alike with their
own compute types, bfloat16 A/B with ``CUBLAS_COMPUTE_32F``, float32 scale
and a bfloat16 or float32 C/D, the bias of D's type --
``BIAS_DATA_TYPE`` defaults to it; a float32 bias with a bfloat16 D is
``NOT_SUPPORTED``), the shapes (op(A) (m, k), op(B) (k, n), C and D (m,
n)), writes its algorithm (for that configuration, the alignments the
preference promised, a workspace of up to 1 MiB within
``MAX_WORKSPACE_BYTES``) into the caller's result array and the count into
its int, 0 where ``no_algorithm(config)`` (a test's hook) says so, a
result whose ``state`` is ``heuristic_state(config)`` (a test's hook: a
non-zero status, its other fields not valid) where that hook says one;
the result array, as nvmath's, is garbage until the heuristic writes it;
``matmul`` refuses an in-place product (C == D) whose Cdesc is not Ddesc,
an algorithm made for another configuration (or none), a workspace
smaller than the algorithm's, a pointer less aligned than the preference
promised, reads alpha and beta (host pointer mode) and the descriptor at
the call, and queues the product on ``stream`` (``capture.device_work``:
recorded into a capture, the operands read when it runs).

The arithmetic: ``D = epilogue(alpha * op(A) @ op(B) + beta * C)``, the
bias added to each row of D (one value per row, as cuBLASLt broadcasts
it). float32 in float32 (TF32-rounded operands under
``COMPUTE_32F_FAST_TF32``), float64 in float64; bfloat16 A/B widened
exactly to float32, the float32 product (NumPy's, laid out as A and B),
plus the bias widened to float32, the ReLU, then one rounding to the
nearest bfloat16 (ties to even) into a bfloat16 D.

``cublasLtCreate`` is refused while the current stream captures (the
emulation's conservative reading: the code makes its handle eagerly).
``module.calls`` records (function name, ...) of every call; ``module.
matmuls`` (epilogue name, type name) of every product; ``module.
heuristics`` the configuration of every heuristic query."""
import ctypes
import enum
import types

import numpy as np

from . import capture
from .host_kernels import (CUDA_R_16BF, CUDA_R_32F, DEFAULT_STREAM, HostCublas, bf16_bits,
                           tf32_round, widen_bits)

CUDA_R_64F = 1
#: cublasComputeType_t values (nvmath.bindings.cublas.ComputeType)
COMPUTE_32F, COMPUTE_32F_FAST_TF32, COMPUTE_64F = 68, 77, 70


class Epilogue(enum.IntEnum):
    DEFAULT = 1
    RELU = 2
    RELU_AUX = 130
    BIAS = 4
    RELU_BIAS = 6
    RELU_AUX_BIAS = 134
    DRELU = 136
    DRELU_BGRAD = 152
    GELU = 32
    GELU_AUX = 160
    GELU_BIAS = 36
    GELU_AUX_BIAS = 164
    DGELU = 192
    DGELU_BGRAD = 208
    BGRADA = 256
    BGRADB = 512


class MatmulDescAttribute(enum.IntEnum):
    COMPUTE_TYPE = 0
    SCALE_TYPE = 1
    POINTER_MODE = 2
    TRANSA = 3
    TRANSB = 4
    TRANSC = 5
    FILL_MODE = 6
    EPILOGUE = 7
    BIAS_POINTER = 8
    BIAS_BATCH_STRIDE = 10
    EPILOGUE_AUX_POINTER = 11
    EPILOGUE_AUX_LD = 12
    BIAS_DATA_TYPE = 26


class MatmulPreferenceAttribute(enum.IntEnum):
    SEARCH_MODE = 0
    MAX_WORKSPACE_BYTES = 1
    MIN_ALIGNMENT_A_BYTES = 5
    MIN_ALIGNMENT_B_BYTES = 6
    MIN_ALIGNMENT_C_BYTES = 7
    MIN_ALIGNMENT_D_BYTES = 8


class MatrixLayoutAttribute(enum.IntEnum):
    TYPE = 0
    ORDER = 1
    ROWS = 2
    COLS = 3
    LD = 4


_DESC_DTYPES = {MatmulDescAttribute.COMPUTE_TYPE: np.int32,
                MatmulDescAttribute.SCALE_TYPE: np.int32,
                MatmulDescAttribute.POINTER_MODE: np.int32,
                MatmulDescAttribute.TRANSA: np.int32, MatmulDescAttribute.TRANSB: np.int32,
                MatmulDescAttribute.TRANSC: np.int32, MatmulDescAttribute.FILL_MODE: np.int32,
                MatmulDescAttribute.EPILOGUE: np.uint32,
                MatmulDescAttribute.BIAS_POINTER: np.int64,
                MatmulDescAttribute.BIAS_BATCH_STRIDE: np.int64,
                MatmulDescAttribute.EPILOGUE_AUX_POINTER: np.int64,
                MatmulDescAttribute.EPILOGUE_AUX_LD: np.int64,
                MatmulDescAttribute.BIAS_DATA_TYPE: np.int32}
_PREF_DTYPES = {MatmulPreferenceAttribute.SEARCH_MODE: np.uint32,
                MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES: np.uint64,
                MatmulPreferenceAttribute.MIN_ALIGNMENT_A_BYTES: np.uint32,
                MatmulPreferenceAttribute.MIN_ALIGNMENT_B_BYTES: np.uint32,
                MatmulPreferenceAttribute.MIN_ALIGNMENT_C_BYTES: np.uint32,
                MatmulPreferenceAttribute.MIN_ALIGNMENT_D_BYTES: np.uint32}

#: nvmath's cublasLtMatmulAlgo_t and cublasLtMatmulHeuristicResult_t
matmul_algo_dtype = np.dtype([("data_", "<u8", (8,))], align=True)
matmul_heuristic_result_dtype = np.dtype(
    [("algo", matmul_algo_dtype), ("workspace_size", "<u8"), ("state", "<i4"),
     ("waves_count", "<f4"), ("reserved", "<i4", (4,))], align=True)
#: the first word of an emulated algorithm
_MAGIC = 0x4C54414C474F   # "LTALGO"
#: the most workspace an emulated algorithm asks for
ALGO_WORKSPACE = 1 << 20

_TYPE_NAMES = {CUDA_R_32F: "float32", CUDA_R_64F: "float64", CUDA_R_16BF: "bfloat16"}
_STORAGE = {CUDA_R_32F: np.float32, CUDA_R_64F: np.float64, CUDA_R_16BF: np.uint16}
_STATUS = {"NOT_INITIALIZED": 1, "INVALID_VALUE": 7, "NOT_SUPPORTED": 15}


class cuBLASLtError(Exception):  # noqa: N801  (nvmath's name)
    def __init__(self, status, what=""):
        self.status = status
        super().__init__(f"CUBLAS_STATUS_{status}" + (f" ({what})" if what else ""))


class MatmulHeuristicResult:
    """An array of ``size`` cublasLtMatmulHeuristicResult_t (nvmath's class:
    ``ptr`` its address, ``workspace_size`` and ``state`` read from it)."""

    def __init__(self, size=1):   # "empty-initialize": garbage until written
        self._data = np.empty(size, dtype=matmul_heuristic_result_dtype)
        self._data.view(np.uint8)[...] = 0xA5

    @property
    def ptr(self):
        return self._data.ctypes.data

    def _field(self, name):
        values = self._data[name]
        return values[0].item() if len(values) == 1 else values

    @property
    def workspace_size(self):
        return self._field("workspace_size")

    @property
    def state(self):
        return self._field("state")

    def __len__(self):
        return len(self._data)


def _read(ptr, dtype, size):
    dtype = np.dtype(dtype)
    if size != dtype.itemsize:
        raise cuBLASLtError("INVALID_VALUE", f"an attribute of {dtype} set with {size} bytes")
    return np.frombuffer((ctypes.c_char * size).from_address(int(ptr)), dtype=dtype)[0].item()


def _aligned(ptr, align):
    return int(ptr) % max(int(align), 1) == 0


def emulated_nvmath_cublaslt():
    """A module standing in for ``nvmath.bindings.cublasLt`` (the module
    docstring)."""
    module = types.ModuleType("nvmath.bindings.cublasLt")
    for cls in (Epilogue, MatmulDescAttribute, MatmulPreferenceAttribute, MatrixLayoutAttribute,
                cuBLASLtError, MatmulHeuristicResult):
        setattr(module, cls.__name__, cls)
    module.matmul_algo_dtype = matmul_algo_dtype
    module.matmul_heuristic_result_dtype = matmul_heuristic_result_dtype
    module.calls, module.matmuls, module.heuristics = [], [], []
    module.no_algorithm = None    # a test's hook: config -> True where no algorithm is found
    module.heuristic_state = None  # a test's hook: config -> the state of the result returned
    objects = {}                  # handle/descriptor/layout/preference -> its state
    configs = {}                  # algorithm id -> the configuration it was found for
    counter = iter(range(0x1000, 1 << 40, 16))
    host = HostCublas()

    def new(kind, **state):
        ptr = next(counter)
        objects[ptr] = dict(state, kind=kind)
        return ptr

    def get(ptr, kind, what):
        module.calls.append((what, int(ptr)))
        state = objects.get(int(ptr))
        if state is None or state["kind"] != kind:
            raise cuBLASLtError("NOT_INITIALIZED" if kind == "handle" else "INVALID_VALUE",
                                f"{what}: no {kind} {ptr:#x}")
        return state

    def drop(ptr, kind, what):
        get(ptr, kind, what)
        del objects[int(ptr)]

    def create():
        module.calls.append(("create",))
        if capture.is_capturing():
            raise RuntimeError("emulated cublasLtCreate: called while the current stream "
                               "captures a CUDA graph (make the handle eagerly)")
        return new("handle")

    def destroy(light_handle):
        drop(light_handle, "handle", "destroy")

    def matmul_desc_create(compute_type, scale_type):
        module.calls.append(("matmul_desc_create", compute_type, scale_type))
        if compute_type not in (COMPUTE_32F, COMPUTE_32F_FAST_TF32, COMPUTE_64F) or \
                scale_type not in (CUDA_R_32F, CUDA_R_64F):
            raise cuBLASLtError("NOT_SUPPORTED", f"compute type {compute_type}, scale type "
                                f"{scale_type} (not emulated)")
        return new("desc", attrs={MatmulDescAttribute.COMPUTE_TYPE: int(compute_type),
                                  MatmulDescAttribute.SCALE_TYPE: int(scale_type),
                                  MatmulDescAttribute.POINTER_MODE: 0,
                                  MatmulDescAttribute.TRANSA: 0, MatmulDescAttribute.TRANSB: 0,
                                  MatmulDescAttribute.EPILOGUE: int(Epilogue.DEFAULT),
                                  MatmulDescAttribute.BIAS_POINTER: 0})

    def matmul_desc_destroy(matmul_desc):
        drop(matmul_desc, "desc", "matmul_desc_destroy")

    def get_matmul_desc_attribute_dtype(attr):
        return _DESC_DTYPES[MatmulDescAttribute(attr)]

    def matmul_desc_set_attribute(matmul_desc, attr, buf, size_in_bytes):
        state = get(matmul_desc, "desc", "matmul_desc_set_attribute")
        attr = MatmulDescAttribute(attr)
        state["attrs"][attr] = _read(buf, _DESC_DTYPES[attr], size_in_bytes)

    def matrix_layout_create(type, rows, cols, ld):  # noqa: A002  (nvmath's name)
        module.calls.append(("matrix_layout_create", type, rows, cols, ld))
        if type not in _STORAGE:
            raise cuBLASLtError("NOT_SUPPORTED", f"data type {type} (not emulated)")
        if ld < max(1, rows):
            raise cuBLASLtError("INVALID_VALUE", f"a column-major layout of {rows} rows with "
                                f"ld {ld}")
        return new("layout", type=int(type), rows=int(rows), cols=int(cols), ld=int(ld))

    def matrix_layout_destroy(mat_layout):
        drop(mat_layout, "layout", "matrix_layout_destroy")

    def matmul_preference_create():
        return new("pref", attrs={MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES: 0,
                                  **{MatmulPreferenceAttribute[f"MIN_ALIGNMENT_{n}_BYTES"]: 256
                                     for n in "ABCD"}})

    def matmul_preference_destroy(pref):
        drop(pref, "pref", "matmul_preference_destroy")

    def get_matmul_preference_attribute_dtype(attr):
        return _PREF_DTYPES[MatmulPreferenceAttribute(attr)]

    def matmul_preference_set_attribute(pref, attr, buf, size_in_bytes):
        state = get(pref, "pref", "matmul_preference_set_attribute")
        attr = MatmulPreferenceAttribute(attr)
        state["attrs"][attr] = _read(buf, _PREF_DTYPES[attr], size_in_bytes)

    def config_of(desc, a, b, c, d):
        """The operation's configuration (a hashable tuple), checked against
        the datatype table and the shapes; raises cuBLASLtError."""
        A = MatmulDescAttribute
        attrs = dict(desc["attrs"])
        compute, scale = attrs[A.COMPUTE_TYPE], attrs[A.SCALE_TYPE]
        epilogue = Epilogue(attrs[A.EPILOGUE])
        bias_type = attrs.get(A.BIAS_DATA_TYPE, d["type"])   # defaults to D's type
        if a["type"] != b["type"] or c["type"] != d["type"]:
            raise cuBLASLtError("NOT_SUPPORTED", "A/B or C/D of different types")
        ab, dc = a["type"], d["type"]
        uses_bias = epilogue in (Epilogue.BIAS, Epilogue.RELU_BIAS, Epilogue.GELU_BIAS)
        if ab == CUDA_R_32F:
            ok = dc == CUDA_R_32F and compute in (COMPUTE_32F, COMPUTE_32F_FAST_TF32) and \
                scale == CUDA_R_32F and bias_type == CUDA_R_32F
        elif ab == CUDA_R_64F:
            ok = dc == CUDA_R_64F and compute == COMPUTE_64F and scale == CUDA_R_64F and \
                bias_type == CUDA_R_64F
        else:   # bfloat16 A/B: C/D bfloat16 (bias bfloat16) or float32 (bias float32)
            ok = ab == CUDA_R_16BF and compute == COMPUTE_32F and scale == CUDA_R_32F and \
                dc in (CUDA_R_16BF, CUDA_R_32F) and bias_type == dc
        if not ok:
            raise cuBLASLtError("NOT_SUPPORTED", f"A/B {ab}, C/D {dc}, compute {compute}, "
                                f"scale {scale}, bias {bias_type} (cublasLtMatmul's table)")
        if epilogue not in (Epilogue.DEFAULT, Epilogue.RELU, Epilogue.BIAS, Epilogue.RELU_BIAS):
            raise cuBLASLtError("NOT_SUPPORTED", f"epilogue {epilogue.name} (not emulated)")
        if uses_bias and not attrs[A.BIAS_POINTER]:
            raise cuBLASLtError("INVALID_VALUE", f"epilogue {epilogue.name} without a bias")
        ta, tb = attrs[A.TRANSA], attrs[A.TRANSB]
        m, k = (a["rows"], a["cols"]) if ta == 0 else (a["cols"], a["rows"])
        k2, n = (b["rows"], b["cols"]) if tb == 0 else (b["cols"], b["rows"])
        if k != k2 or (c["rows"], c["cols"]) != (m, n) or (d["rows"], d["cols"]) != (m, n):
            raise cuBLASLtError("INVALID_VALUE", f"op(A) {(m, k)} @ op(B) {(k2, n)} into C "
                                f"{(c['rows'], c['cols'])}, D {(d['rows'], d['cols'])}")
        layouts = tuple((x["type"], x["rows"], x["cols"], x["ld"]) for x in (a, b, c, d))
        return (compute, scale, ta, tb, int(epilogue), bias_type, attrs[A.BIAS_POINTER] != 0,
                layouts)

    def matmul_algo_get_heuristic(light_handle, operation_desc, adesc, bdesc, cdesc, ddesc,
                                  preference, requested_algo_count, heuristic_results_array,
                                  return_algo_count):
        get(light_handle, "handle", "matmul_algo_get_heuristic")
        desc = get(operation_desc, "desc", "matmul_algo_get_heuristic")
        a, b, c, d = (get(x, "layout", "matmul_algo_get_heuristic")
                      for x in (adesc, bdesc, cdesc, ddesc))
        pref = get(preference, "pref", "matmul_algo_get_heuristic")["attrs"]
        if requested_algo_count < 1:
            raise cuBLASLtError("INVALID_VALUE", "requestedAlgoCount < 1")
        config = config_of(desc, a, b, c, d)
        module.heuristics.append(config)
        count = np.frombuffer((ctypes.c_char * 4).from_address(int(return_algo_count)),
                              dtype=np.int32)
        hook = module.no_algorithm
        if hook is not None and hook(config):
            count[0] = 0
            return
        P = MatmulPreferenceAttribute
        aligns = tuple(pref[P[f"MIN_ALIGNMENT_{n}_BYTES"]] for n in "ABCD")
        need = min(ALGO_WORKSPACE, pref[P.MAX_WORKSPACE_BYTES])
        results = np.frombuffer(
            (ctypes.c_char * matmul_heuristic_result_dtype.itemsize).from_address(
                int(heuristic_results_array)), dtype=matmul_heuristic_result_dtype)
        state = module.heuristic_state(config) if module.heuristic_state is not None else 0
        if state:   # a result whose other fields are not valid (cuBLAS: inspect .state)
            results[0]["state"] = state
            count[0] = 1
            return
        algo_id = len(configs) + 1
        configs[algo_id] = (config, aligns, need)
        results[0]["algo"]["data_"][:2] = (_MAGIC, algo_id)
        results[0]["workspace_size"], results[0]["state"] = need, 0
        results[0]["waves_count"] = 1.0
        count[0] = 1

    def matmul(light_handle, compute_desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc,
               algo, workspace, workspace_size_in_bytes, stream):
        get(light_handle, "handle", "matmul")
        desc = get(compute_desc, "desc", "matmul")
        la, lb, lc, ld = (get(x, "layout", "matmul") for x in (adesc, bdesc, cdesc, ddesc))
        if int(c) == int(d) and int(cdesc) != int(ddesc):
            raise cuBLASLtError("INVALID_VALUE", "in place (C == D) with Cdesc != Ddesc")
        config = config_of(desc, la, lb, lc, ld)
        words = np.frombuffer((ctypes.c_char * 64).from_address(int(algo)), dtype=np.uint64)
        found = configs.get(int(words[1])) if int(words[0]) == _MAGIC else None
        if found is None or found[0] != config:
            raise cuBLASLtError("INVALID_VALUE", "an algorithm found for another configuration")
        _, aligns, need = found
        if workspace_size_in_bytes < need or (need and not workspace):
            raise cuBLASLtError("NOT_SUPPORTED", f"the algorithm needs {need} bytes of "
                                f"workspace, given {workspace_size_in_bytes} at {workspace:#x}")
        for name, ptr, align in zip("ABCD", (a, b, c, d), aligns):
            if not _aligned(ptr, align):
                raise cuBLASLtError("INVALID_VALUE", f"{name} at {ptr:#x} is not aligned to "
                                    f"the {align} bytes the preference promised")
        A = MatmulDescAttribute
        attrs = dict(desc["attrs"])
        compute, ta, tb = attrs[A.COMPUTE_TYPE], attrs[A.TRANSA], attrs[A.TRANSB]
        epilogue = Epilogue(attrs[A.EPILOGUE])
        bias_ptr, bias_type = attrs[A.BIAS_POINTER], attrs.get(A.BIAS_DATA_TYPE, ld["type"])
        scalar = np.float64 if attrs[A.SCALE_TYPE] == CUDA_R_64F else np.float32
        alpha, beta = host._scalar(alpha, scalar), host._scalar(beta, scalar)  # read now
        module.matmuls.append((epilogue.name, _TYPE_NAMES[la["type"]]))

        def view(ptr, layout):
            return host._view(ptr, _STORAGE[layout["type"]], layout["rows"], layout["cols"],
                              layout["ld"], 0, 1)[0]

        va, vb, vc, vd = view(a, la), view(b, lb), view(c, lc), view(d, ld)
        m = vd.shape[0]
        vbias = (host._view(bias_ptr, _STORAGE[bias_type], m, 1, m, 0, 1)[0][:, 0]
                 if bias_ptr else None)
        low = la["type"] == CUDA_R_16BF

        def value(x, data_type):
            return widen_bits(x, CUDA_R_16BF) if data_type == CUDA_R_16BF else x

        def run():   # device work: reads the operands when it runs
            op_a = value(va, la["type"])
            op_b = value(vb, lb["type"])
            op_a, op_b = (op_a if ta == 0 else op_a.T), (op_b if tb == 0 else op_b.T)
            if compute == COMPUTE_32F_FAST_TF32:
                op_a, op_b = tf32_round(op_a), tf32_round(op_b)
            acc = np.float32 if low else _STORAGE[ld["type"]]
            out = np.matmul(op_a, op_b).astype(acc, copy=False)
            if alpha != 1:
                out = out * acc(alpha)
            if beta != 0:
                out = out + acc(beta) * value(vc, lc["type"]).astype(acc)
            if epilogue in (Epilogue.BIAS, Epilogue.RELU_BIAS):
                out = out + value(vbias, bias_type).astype(acc).reshape(-1, 1)
            if epilogue in (Epilogue.RELU, Epilogue.RELU_BIAS):
                out = np.maximum(out, acc(0))
            if ld["type"] == CUDA_R_16BF:   # one rounding of the float32 result
                vd[...] = bf16_bits(np.ascontiguousarray(out, np.float32))
            else:
                vd[...] = out

        stream_obj = capture.stream_of(int(stream)) if stream else None
        capture.device_work(run, stream_obj or DEFAULT_STREAM)

    for fn in (create, destroy, matmul_desc_create, matmul_desc_destroy,
               get_matmul_desc_attribute_dtype, matmul_desc_set_attribute, matrix_layout_create,
               matrix_layout_destroy, matmul_preference_create, matmul_preference_destroy,
               get_matmul_preference_attribute_dtype, matmul_preference_set_attribute,
               matmul_algo_get_heuristic, matmul):
        setattr(module, fn.__name__, fn)
    return module
