"""Check, in under a minute, each assumption purine_mpi's GPU path rests on.

    python benchmarks/gpu_probe.py [--out DIR] [--wheels benchmarks/gpu_wheels.txt]

Run first on a GPU machine (``benchmarks/gpu_session.sh probe``), before any
stage spends minutes on something that cannot work. Each check prints one
line, ``PASS``, ``FAIL`` or ``SKIP``, its name and why:

    python        the interpreter is the version the wheels were fetched for
    wheels        every pinned wheel is installed (the version, when it is not the pin)
    pip-check     ``pip check``: the installed packages hold together
    cuda-device   CuPy imports and sees a device (name, compute capability, runtime)
    nvmath-capture  a cuBLAS product through nvmath (gpu/blas.py) captured in a
                  CUDA graph, replayed on new operands, equals NumPy's
    cudnn-capture a cuDNN frontend convolution (gpu/cudnn.py's plan) executed
                  inside a capture, replayed on new inputs, equals NumPy's
    memcpy-replay a pinned host-to-device ``cudaMemcpyAsync`` (gpu/streams.py)
                  captured, replayed, reads what the pinned buffer holds then
    abort-capture a capture that an error invalidates is ended by
                  ``CudaRuntime.abort_capture``; the stream works afterwards
    nccl-capture  a one-rank ``ncclAllReduce`` (CuPy's NCCL binding) captured
                  in a CUDA graph and replayed
    mpi-world-2   ``mpiexec -n 2``: both ranks see a world of 2

A check whose prerequisite failed is SKIP, naming it. The lines also go to
``DIR/probe.txt`` and, as one JSON object, ``DIR/probe.json``. Exit status:
0 when nothing failed, 1 otherwise (a missing GPU is a FAIL, said in one
line, never a traceback).
"""
import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WHEELS_FILE = REPO / "benchmarks" / "gpu_wheels.txt"


class Skip(Exception):
    """A check that cannot run here; its message says why."""


def pins(path):
    """({distribution: version}, python "X.Y", {names installed without their
    dependencies}) from the pinned wheels file."""
    wanted, python, nodeps = {}, None, set()
    for line in Path(path).read_text().splitlines():
        text = line.strip()
        if text.startswith("#") and "python-version:" in text:
            python = text.split("python-version:", 1)[1].split()[0]
        elif text.startswith("#") and "no-deps:" in text:
            nodeps.update(n.lower() for n in text.split("no-deps:", 1)[1].split())
        elif text and not text.startswith("#"):
            name, _, version = text.partition("==")
            wanted[name.strip()] = version.strip()
    return wanted, python, nodeps


def check_python(ctx):
    have = "%d.%d" % sys.version_info[:2]
    if ctx["python"] is None:
        raise Skip(f"{ctx['wheels']} names no python-version")
    if have != ctx["python"]:
        raise AssertionError(f"python {have}, the wheels are fetched for {ctx['python']} "
                             f"(FETCH_PYTHON_VERSION={have} benchmarks/gpu_session.sh fetch)")
    return f"python {sys.version.split()[0]} ({sys.executable})"


def check_wheels(ctx):
    from importlib import metadata
    missing, other = [], []
    for name, version in ctx["pins"].items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        if version and have != version:
            other.append(f"{name} {have} (pin {version})")
    if missing:
        raise AssertionError("not installed: " + ", ".join(missing) +
                             (("; " + ", ".join(other)) if other else ""))
    return f"{len(ctx['pins'])} installed" + (("; the image's: " + ", ".join(other))
                                               if other else ", all at their pins")


def check_pip(ctx):
    res = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True,
                         text=True, timeout=60)
    lines = (res.stdout + res.stderr).strip().splitlines()
    # what the pins file installs without its dependencies may miss them, nothing else
    accepted = [line for line in lines if line.split()[0].lower() in ctx["nodeps"]
                and line.rstrip(".").endswith("which is not installed")]
    problems = [line for line in lines if line not in accepted]
    if res.returncode != 0 and problems:
        raise AssertionError(f"{len(problems)} problem(s); first: {problems[0]}")
    if accepted:
        return "accepted (no-deps in the pins): " + "; ".join(accepted)
    return lines[0] if lines else "ok"


def _cupy(ctx):
    if ctx.get("cupy") is None:
        raise Skip("needs a CUDA device (see cuda-device)")
    return ctx["cupy"]


def check_device(ctx):
    try:
        import cupy
    except ImportError as exc:
        raise AssertionError(f"CuPy does not import: {exc}")
    count = cupy.cuda.runtime.getDeviceCount()
    if count < 1:
        raise AssertionError("CuPy sees no CUDA device")
    device = cupy.cuda.Device(0)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    ctx["cupy"] = cupy
    return (f"{count} device(s), 0: {name}, sm_{device.compute_capability}, "
            f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}")


def _captured(cupy, queue):
    """``queue()`` captured on a new stream into a graph; the graph and stream."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            queue()
        finally:
            graph = stream.end_capture()
    return graph, stream


def check_nvmath(ctx):
    cupy = _cupy(ctx)
    from purine_mpi.gpu import blas
    if blas.blas_backend() != "nvmath":
        raise AssertionError(f"the cuBLAS binding is {blas.blas_backend()!r}: "
                             f"{blas.blas_note()}")
    rng = np.random.default_rng(0)
    a = cupy.asarray(rng.standard_normal((64, 48)), dtype=cupy.float32)
    b = cupy.asarray(rng.standard_normal((48, 32)), dtype=cupy.float32)
    c = cupy.zeros((64, 32), dtype=cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    blas.reserve(stream)    # the handle and workspace are made before the capture
    with stream:
        stream.begin_capture()
        try:
            blas.gemm(a, b, c)
        finally:
            graph = stream.end_capture()
    for trial in range(2):   # a replay reads the operands as they are then
        new_a = cupy.asarray(rng.standard_normal((64, 48)), dtype=cupy.float32)
        with stream:   # ordered before the replay on its stream
            a[...] = new_a
        graph.launch(stream)
        stream.synchronize()
        want = cupy.asnumpy(a).astype(np.float64) @ cupy.asnumpy(b).astype(np.float64)
        err = float(np.max(np.abs(cupy.asnumpy(c) - want)))
        if err > 1e-3:
            raise AssertionError(f"replay {trial}: max |error| {err:.3g} against NumPy")
    return f"captured sgemm replayed twice, max |error| {err:.2g}"


def conv_reference(x, w, pad):
    """NCHW cross-correlation, stride 1, in float64 (NumPy)."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = h + 2 * pad - kh + 1, wd + 2 * pad - kw + 1
    y = np.zeros((n, o, oh, ow))
    for i in range(kh):
        for j in range(kw):
            y += np.einsum("nchw,oc->nohw", xp[:, :, i:i + oh, j:j + ow], w[:, :, i, j])
    return y


def check_cudnn(ctx):
    cupy = _cupy(ctx)
    from purine_mpi.gpu import cudnn as gcudnn
    module = gcudnn.frontend()
    if module is None:
        raise AssertionError(f"no cuDNN frontend: {gcudnn.fallback_reason()}")
    geo = dict(N=2, C=3, H=8, W=8, O=4, kh=3, kw=3, OH=8, OW=8, ph=1, pw=1, sh=1, sw=1,
               dh=1, dw=1, G=1)
    plan = gcudnn.ConvPlan(module, 0, "fprop", geo, np.float32)   # built before the capture
    rng = np.random.default_rng(1)
    x = cupy.asarray(rng.standard_normal((2, 3, 8, 8)), dtype=cupy.float32)
    w = cupy.asarray(rng.standard_normal((4, 3, 3, 3)), dtype=cupy.float32)
    y = cupy.zeros((2, 4, 8, 8), dtype=cupy.float32)
    workspace = cupy.empty(max(1, plan.workspace_bytes), dtype=cupy.uint8)
    graph, stream = _captured(cupy, lambda: plan.execute({"x": x, "w": w, "y": y}, workspace))
    for trial in range(2):
        new_x = cupy.asarray(rng.standard_normal((2, 3, 8, 8)), dtype=cupy.float32)
        with stream:   # ordered before the replay on its stream
            x[...] = new_x
        graph.launch(stream)
        stream.synchronize()
        err = float(np.max(np.abs(cupy.asnumpy(y) - conv_reference(
            cupy.asnumpy(x), cupy.asnumpy(w).astype(np.float64), 1))))
        if err > 1e-3:
            raise AssertionError(f"replay {trial}: max |error| {err:.3g} against NumPy")
    return (f"cuDNN {module.backend_version()} fprop captured, replayed twice, "
            f"max |error| {err:.2g}")


def check_memcpy(ctx):
    cupy = _cupy(ctx)
    from purine_mpi.gpu import streams
    src = streams.pinned_empty((1000,), np.float32)
    src[...] = 1.0
    dst = cupy.zeros((1000,), dtype=cupy.float32)
    graph, stream = _captured(cupy, lambda: streams.copy_to_device_async(dst, src))
    for value in (2.0, 3.0):   # the replay reads the pinned buffer as it is then
        src[...] = value
        graph.launch(stream)
        stream.synchronize()
        got = cupy.asnumpy(dst)
        if not np.all(got == value):
            raise AssertionError(f"replay after writing {value}: the device holds "
                                 f"{np.unique(got)[:4]}")
    return "a captured pinned cudaMemcpyAsync read the buffer anew at each replay"


def check_abort(ctx):
    cupy = _cupy(ctx)
    from purine_mpi.runtime.cuda_runtime import CudaRuntime
    runtime = CudaRuntime()
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones((16,), dtype=cupy.float32)
    error = None
    with stream:
        stream.begin_capture()
        try:
            # synchronising a capturing stream is illegal: CUDA invalidates the capture
            cupy.cuda.runtime.streamSynchronize(stream.ptr)
        except Exception as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        runtime.abort_capture(0, stream)
    if error is None:
        raise AssertionError("synchronising a capturing stream did not fail")
    try:
        capturing = stream.is_capturing()
    except Exception as exc:
        raise AssertionError(f"after abort_capture the stream still fails: "
                             f"{type(exc).__name__}: {exc}")
    if capturing:
        raise AssertionError("after abort_capture the stream is still capturing")
    with stream:
        y = x * 2
    stream.synchronize()
    if float(cupy.asnumpy(y).sum()) != 32.0:
        raise AssertionError("work queued after the abort computed a wrong result")
    return f"the invalidated capture ({error}) ended; the stream runs work again"


def check_nccl(ctx):
    cupy = _cupy(ctx)
    from purine_mpi.comm import nccl as pnccl
    nccl, why = pnccl.nccl_module()
    if nccl is None:
        raise AssertionError(why)
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)   # one rank: a sum of one
    from purine_mpi.gpu.raw import data_ptr
    x = cupy.asarray(np.arange(1024, dtype=np.float32))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            comm.allReduce(data_ptr(x), data_ptr(x), x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           stream.ptr)
            x *= 2
        finally:
            graph = stream.end_capture()
    for trial in (1, 2):
        graph.launch(stream)
        stream.synchronize()
        if not np.array_equal(cupy.asnumpy(x), np.arange(1024, dtype=np.float32) * 2 ** trial):
            raise AssertionError(f"replay {trial}: wrong values after ncclAllReduce")
    comm.destroy()
    return f"NCCL {nccl.get_version()}: ncclAllReduce captured and replayed twice (1 rank)"


def check_mpi(ctx):
    try:
        importlib.import_module("mpi4py")
    except ImportError as exc:
        raise AssertionError(f"mpi4py does not import: {exc}")
    mpiexec = Path(sysconfig.get_path("scripts")) / "mpiexec"
    mpiexec = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        raise AssertionError("no mpiexec next to the interpreter nor on PATH")
    code = ("from mpi4py import MPI; w = MPI.COMM_WORLD; "
            "s = w.gather((w.Get_rank(), w.Get_size())); w.Get_rank() or print(s)")
    res = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=30)
    seen = " ".join(res.stdout.split())   # rank 0's [(rank, size), ...]; singletons print twice
    if res.returncode != 0 or seen != "[(0, 2), (1, 2)]":
        tail = (res.stderr.strip().splitlines() or ["no error output"])[-1]
        raise AssertionError(f"mpiexec -n 2 exit {res.returncode}, rank 0 saw "
                             f"{seen or 'nothing'}: {tail}")
    return f"2 ranks, each sees a world of 2 ({mpiexec})"


CHECKS = (("python", check_python), ("wheels", check_wheels), ("pip-check", check_pip),
          ("cuda-device", check_device), ("nvmath-capture", check_nvmath),
          ("cudnn-capture", check_cudnn), ("memcpy-replay", check_memcpy),
          ("abort-capture", check_abort), ("nccl-capture", check_nccl),
          ("mpi-world-2", check_mpi))


def run_check(fn, ctx):
    """(status, one line why) of one check; nothing escapes."""
    try:
        return "PASS", fn(ctx)
    except Skip as exc:
        return "SKIP", str(exc)
    except AssertionError as exc:
        return "FAIL", str(exc)
    except subprocess.TimeoutExpired as exc:
        return "FAIL", f"timed out after {exc.timeout:.0f} s"
    except Exception as exc:   # an unexpected error is a failed assumption too
        where = traceback.extract_tb(exc.__traceback__)[-1]
        text = str(exc).splitlines()[0] if str(exc) else ""
        return "FAIL", (f"{type(exc).__name__}: {text} "
                        f"({Path(where.filename).name}:{where.lineno})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_session_out"))
    ap.add_argument("--wheels", default=str(WHEELS_FILE))
    ap.add_argument("--only", nargs="+", choices=[name for name, _ in CHECKS],
                    help="run only these checks")
    args = ap.parse_args(argv)
    wanted, python, nodeps = pins(args.wheels)
    ctx = {"pins": wanted, "python": python, "nodeps": nodeps, "wheels": args.wheels}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, lines = [], []
    for name, fn in CHECKS:
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        status, why = run_check(fn, ctx)
        seconds = time.perf_counter() - t0
        line = f"{status:4}  {name:15} {' '.join(str(why).split())}"
        print(line, flush=True)
        lines.append(line)
        results.append({"check": name, "status": status, "why": why,
                        "seconds": round(seconds, 3)})
    failed = [r["check"] for r in results if r["status"] == "FAIL"]
    (out / "probe.txt").write_text("\n".join(lines) + "\n")
    (out / "probe.json").write_text(json.dumps({"probe": results, "failed": failed},
                                               indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
