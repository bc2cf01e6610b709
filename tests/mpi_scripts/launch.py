"""Launch a script of this folder under ``mpiexec -n K`` from a pytest test.

``mpiexec`` is looked up next to ``sys.executable`` (the venv's MPICH from
PyPI), then on PATH; tests skip cleanly when there is none."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def find_mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(local):
        return local
    return shutil.which("mpiexec")


def mpiexec_args(n):
    exe = find_mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found (install the 'mpich' package: pip install mpich)")
    args = [exe, "-n", str(n)]
    if "open" in _flavour(exe):  # Open MPI: root and more ranks than cores
        args[1:1] = ["--allow-run-as-root", "--oversubscribe"]
    return args


def _flavour(exe):
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
        return (out.stdout + out.stderr).lower()
    except Exception:
        return ""


def run_mpi(script, n, *args, timeout=60, expect_ok=True, env=None, launcher_args=()):
    """Run ``tests/mpi_scripts/<script>`` on ``n`` ranks; returns
    (CompletedProcess, seconds). With ``expect_ok`` a non-zero exit fails
    the test with the combined output. ``launcher_args``: mpiexec's own
    options (before the program)."""
    return run_python(n, [os.path.join(HERE, script)] + [str(a) for a in args], timeout,
                      expect_ok, env, script, launcher_args)


def run_python(n, python_args, timeout=60, expect_ok=True, env=None, script=None,
               launcher_args=()):
    """``mpiexec -n n python <python_args>`` (e.g. ["-m", "purine_mpi", "train", ...])."""
    script = script or " ".join(python_args[:3])
    cmd = mpiexec_args(n) + list(launcher_args) + [sys.executable] + [str(a) for a in python_args]
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    t0 = time.monotonic()
    # own process group, so a hung job can be killed whole (mpiexec and ranks)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} on {n} ranks did not finish in {timeout} s:\n{out}\n{err}")
    proc = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    elapsed = time.monotonic() - t0
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{script} on {n} ranks exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc, elapsed
