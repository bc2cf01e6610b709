"""The ``PURINE_*`` environment variables, in one table: name, type,
default, meaning (``VARS``; docs/environment.md's table lists the same). Each is
checked like a config key: ``get(name)`` is the parsed value (the default
when unset or blank) and raises ``EnvError`` (exit 2) naming the variable
and what it takes; the CLI checks them all before any command runs
(``check_all``), so a typo in a job script never runs with a default
instead, nor fails later with a traceback. The variables that steer the GPU
path alone (``GPU_ONLY``) have no effect on a run on the CPU:
``cpu_note()`` is the one line that says so where one is set.
"""
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from .errors import UserError, excerpt


class EnvError(UserError, ValueError):
    """A ``PURINE_*`` variable set to a value it does not take (exit 2)."""


@dataclass(frozen=True)
class Var:
    name: str
    kind: str          # what it takes, in words ("a positive integer")
    default: Any       # when unset or blank
    parse: Callable    # text -> value; ValueError when the text is not one
    meaning: str
    gpu_only: bool = False  # read on the GPU path alone


def _positive_int(text):
    value = int(text)
    if value <= 0:
        raise ValueError
    return value


def _non_negative_int(text):
    value = int(text)
    if value < 0:
        raise ValueError
    return value


def _non_negative_number(text):
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError
    return value


_FLAGS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def _flag(text):
    return _FLAGS[text.lower()]


def _choice(*choices):
    def parse(text):
        if text.lower() not in choices:
            raise ValueError
        return text.lower()
    return parse


def _comm_delay(text):
    """``MAX_MS[:SEED]`` -> (max seconds, seed)."""
    ms, sep, seed = text.partition(":")
    if sep and not seed.strip():
        raise ValueError
    return _non_negative_number(ms) / 1000.0, _non_negative_int(seed) if sep else 0


def _md5(text):
    if not re.fullmatch(r"[0-9a-fA-F]{32}", text):
        raise ValueError
    return text.lower()


def _step_on_ranks(text):
    """``STEP[:RANK]`` -> (step >= 1, rank or None: every rank)."""
    step, sep, rank = text.partition(":")
    if sep and not rank.strip():
        raise ValueError
    step = _positive_int(step)
    return step, _non_negative_int(rank) if sep else None


def _text(text):
    return text


FLAG = "0 or 1 (also true/false, yes/no, on/off)"

VARS = {v.name: v for v in [
    Var("PURINE_THREADS", "a positive integer", None, _positive_int,
        "compute threads per rank"),
    Var("PURINE_LOCAL_SIZE", "a positive integer", None, _positive_int,
        "ranks sharing this host, over what the launcher says"),
    Var("PURINE_LOCAL_RANK", "an integer >= 0", None, _non_negative_int,
        "this rank's index on its host (its GPU), over what the launcher says"),
    Var("PURINE_DATA_MEMORY_MB", "a number of MiB >= 0", None, _non_negative_number,
        "the memory budget of `in_memory: auto` data"),
    Var("PURINE_DISPATCHER", "one of event, serial, stream", None,
        _choice("event", "serial", "stream"),
        "the dispatcher, over `--dispatcher` (serial: the reference order)"),
    Var("PURINE_MMAP_THRESHOLD", "an integer number of bytes >= 0", 0, _non_negative_int,
        "glibc's mmap threshold, fixed at start-up: freed arrays of at least that many "
        "bytes go back to the system (0: glibc's dynamic threshold)"),
    Var("PURINE_MALLOC_ARENAS", "an integer number of arenas >= 0", 1, _non_negative_int,
        "glibc's malloc arenas at most, set at start-up (0: glibc's default; "
        "MALLOC_ARENA_MAX in the environment wins)"),
    Var("PURINE_PROGRESS_SECONDS", "a number of seconds >= 0", 10.0, _non_negative_number,
        "seconds between two plain progress lines"),
    Var("PURINE_DEBUG", FLAG, False, _flag,
        "print tracebacks of runtime failures"),
    Var("PURINE_COMM_DELAY", "MAX_MS[:SEED] (numbers >= 0)", None, _comm_delay,
        "developers, tests: a seeded random sleep of up to MAX_MS in every comm op"),
    Var("PURINE_RANKS_PER_HOST", "a positive integer", None, _positive_int,
        "tests, emulation: every N consecutive ranks count as one host for the transport"),
    Var("PURINE_DEBUG_WINDOWS", FLAG, False, _flag,
        "developers, tests: each rank says on stderr when it freed its windows"),
    Var("PURINE_FP16_INJECT_INF", "STEP[:RANK] (integers, STEP >= 1)", None, _step_on_ranks,
        "developers, tests: under `precision: fp16`, a gradient of step STEP (as the log "
        "counts) holds an inf on rank RANK (every rank without it): that step is skipped",
        gpu_only=True),
    Var("PURINE_RMA_ACROSS_HOSTS", FLAG, None, _flag,
        "whether `parallel.transport: auto` uses RMA windows between hosts"),
    Var("PURINE_MPI_CUDA_AWARE", FLAG, None, _flag,
        "whether MPI moves GPU memory directly", gpu_only=True),
    Var("PURINE_CONV", "one of auto, cudnn, im2col", "auto", _choice("auto", "cudnn", "im2col"),
        "the GPU convolution path", gpu_only=True),
    Var("PURINE_SDPA", FLAG, True, _flag,
        "bf16/fp16 fused attention through cuDNN's SDPA where it takes the shape (0: the "
        "cuBLAS + softmax-kernel path)", gpu_only=True),
    Var("PURINE_FC_EPILOGUE", "one of kernel, cublaslt", "kernel", _choice("kernel", "cublaslt"),
        "a fully connected layer's bias and ReLU: our kernel, or the cuBLASLt epilogue "
        "(nvmath.bindings.cublasLt, writing y: captured too); in bf16 with bits storage a "
        "biased fc output becomes one cuBLASLt product whose bias is rounded to bf16 first "
        "(autocast's linear; the default adds the float32 bias before its one rounding)",
        gpu_only=True),
    Var("PURINE_BF16_GEMM", FLAG, True, _flag,
        "bf16 ops' fully connected products as bfloat16 cuBLAS GemmEx on their operands' "
        "bits (0: their float32 storage on TF32 tensor cores)", gpu_only=True),
    Var("PURINE_GELU_BIAS_GRAD", FLAG, False, _flag,
        "the MLP's fc bias gradient summed in GELU's backward pass (one read of dx, "
        "the same bits; off until a GPU has timed it: benchmarks/bias_gelu_gpu.py)",
        gpu_only=True),
    Var("PURINE_LN_SUMS", FLAG, False, _flag,
        "a layer norm's weight and bias gradients summed in its backward pass (no dy * xhat "
        "array; dx the same bits, dg and db the same sums in another order; off until a GPU "
        "has timed it: benchmarks/layernorm_kernel_gpu.py)", gpu_only=True),
    Var("PURINE_BF16_STORAGE", FLAG, True, _flag,
        "bf16: a blob whose every reader takes bfloat16 bits (the fully connected products' "
        "operands, the logits the softmax loss reads) stored as them, 2 bytes an element, "
        "written as bits by its producer "
        "(0: float32 storage, each product converting its operands)", gpu_only=True),
    Var("PURINE_FOLD_WEIGHT_CASTS", FLAG, True, _flag,
        "bf16/fp16: the fused Adam/AdamW update writes each weight's low-precision copy "
        "in its pass over the new weights, instead of a Cast op per weight before the "
        "forward (0: the Cast ops)", gpu_only=True),
    Var("PURINE_CUDNN_BENCHMARK", FLAG, True, _flag,
        "time cuDNN's plans and keep the fastest (0: the heuristic's first)", gpu_only=True),
    Var("PURINE_CUDNN_DETERMINISTIC", FLAG, True, _flag,
        "deterministic cuDNN plans only", gpu_only=True),
    Var("PURINE_CUBLAS_WORKSPACE_MB", "a number of MiB >= 0", 32.0, _non_negative_number,
        "each cuBLAS handle's workspace", gpu_only=True),
    Var("PURINE_CACHE_DIR", "a folder path", None, _text,
        "the cache of timed cuDNN plans and compiled CUDA kernels", gpu_only=True),
    Var("PURINE_CUDA_DIR", "a folder path", None, _text,
        "the CUDA sources", gpu_only=True),
    Var("PURINE_CIFAR10_URL", "a URL", None, _text,
        "where `data cifar10` downloads from (a mirror, a local file://)"),
    Var("PURINE_CIFAR10_MD5", "32 hex digits", None, _md5,
        "the MD5 the CIFAR-10 download must have"),
]}


def parse(name, text, default=None):
    """The value of variable ``name`` written as ``text`` (``default``, else
    the table's, for None or blank); ``EnvError`` when it does not take it."""
    var = VARS[name]
    if text is None or not str(text).strip():
        return var.default if default is None else default
    try:
        return var.parse(str(text).strip())
    except (ValueError, KeyError):
        raise EnvError(f"environment variable {name} must be {var.kind}, got "
                       f"{excerpt(text)} (unset it for the default)") from None


def get(name, environ=None, default=None):
    """The parsed value of ``PURINE_*`` variable ``name`` (see ``parse``)."""
    return parse(name, (os.environ if environ is None else environ).get(name), default)


#: the variables that steer the GPU path alone
GPU_ONLY = tuple(name for name, var in VARS.items() if var.gpu_only)


def cpu_note(environ=None):
    """One line naming the ``GPU_ONLY`` variables set (not blank), which a
    run on the CPU ignores (the start-up block's ``note`` row, ``generate``'s
    note); None when none is set."""
    environ = os.environ if environ is None else environ
    found = [name for name in GPU_ONLY if str(environ.get(name) or "").strip()]
    if not found:
        return None
    one = len(found) == 1
    return (f"{', '.join(found)} {'has' if one else 'have'} no effect: "
            f"{'a GPU setting' if one else 'GPU settings'}, and this run is on the CPU")


def check_all(environ=None):
    """Raise ``EnvError`` for the first variable of ``VARS`` set to a value
    it does not take."""
    environ = os.environ if environ is None else environ
    for name in VARS:
        parse(name, environ.get(name))
