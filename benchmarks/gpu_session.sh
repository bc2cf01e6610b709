#!/usr/bin/env bash
# Every GPU step of purine_mpi in one script, for a machine with a CUDA GPU
# (and no internet: wheels are carried in, not downloaded).
#
#   benchmarks/gpu_session.sh fetch                     (where pip reaches PyPI)
#   benchmarks/gpu_session.sh [all|tests|bench]         (on the GPU machine; default: all)
#
# from the repository root. ``fetch`` downloads into $WHEELS the wheels the
# GPU machine lacks, for its Python (FETCH_PYTHON_VERSION, default 3.12) on
# manylinux x86_64, without their dependencies (each one is named):
#   nvmath-python cuda-bindings cuda-core cuda-pathfinder  matrix products that a
#                                  CUDA graph can capture (CuPy's own cuBLAS refuses)
#   nvidia-cudnn-frontend          convolutions through cuDNN
#   mpich mpi4py                   MPI (the multi-rank tests)
# (FETCH_EXTRA adds names). The other modes write into $OUT (default:
# ./gpu_session_out):
#   env.txt               nvidia-smi, python and package versions, the cuBLAS binding
#   pip_install.log       the carried wheels installed (if any)
#   mpi_check.txt         a 2-rank mpiexec run: both ranks must see a world of 2
#   pytest_gpu.txt        python -m pytest -m gpu (+ pytest_gpu.xml, JUnit)
#   gpu_throughput.json   benchmarks/gpu_throughput.py's report (one JSON object)
#   gpu_throughput.log    its standard error (cuDNN / cuBLAS / capture notes)
#   gpu_dp.json           data parallelism on one GPU: bench of cifar10_quick on 1 rank,
#                         then 2 ranks (host staging), one JSON line each
#                         (images_per_s, comm_overlap, post_latency_ms_worst, staging_ms_per_iter)
#   status.txt            the exit status of each step
#
# Wheels: every *.whl in $WHEELS (default: ./wheels) is installed with
# --no-index --no-deps first, into the interpreter's own site-packages --
# never with --target: there the mpi4py wheel does not find the mpich
# wheel's libmpi and every MPI rank silently runs alone (world size 1).
# Knobs: PYTHON (default python3), BENCH_ARGS (default: both configs, batches
# 128 and 512, 50 iterations), PYTEST_ARGS (extra pytest arguments). The exit
# status is the first failing step's, 0 when every step passed.
set -u

MODE="${1:-all}"
case "$MODE" in
  all|tests|bench|fetch) ;;
  *) echo "usage: $0 [all|tests|bench|fetch]" >&2; exit 2 ;;
esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT="${OUT:-$REPO/gpu_session_out}"
WHEELS="${WHEELS:-$REPO/wheels}"
PYTHON="${PYTHON:-python3}"
BENCH_ARGS="${BENCH_ARGS:---batches 128 512 --iters 50 --warmup 5}"
PYTEST_ARGS="${PYTEST_ARGS:-}"
#: the wheels ``fetch`` downloads (the GPU machine's image has CuPy and PyTorch)
FETCH_WHEELS="nvmath-python cuda-bindings cuda-core cuda-pathfinder nvidia-cudnn-frontend \
mpich mpi4py ${FETCH_EXTRA:-}"

if [ "$MODE" = fetch ]; then
  version="${FETCH_PYTHON_VERSION:-3.12}"
  mkdir -p "$WHEELS"
  # shellcheck disable=SC2086  # FETCH_WHEELS is a list of names
  exec "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$version" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" $FETCH_WHEELS
fi

mkdir -p "$OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
status=0

step() {  # step NAME RC: record a step's exit status, keep the first failure
  echo "$1 $2" >> "$OUT/status.txt"
  if [ "$2" -ne 0 ] && [ "$status" -eq 0 ]; then status="$2"; fi
}

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ "${#wheels[@]}" -gt 0 ]; then
  # the interpreter's own site-packages (no --target, no PIP_TARGET): see above
  env -u PIP_TARGET -u PIP_PREFIX "$PYTHON" -m pip install --no-index --no-deps \
      "${wheels[@]}" > "$OUT/pip_install.log" 2>&1
  step pip_install $?
fi

{
  date -u
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  "$PYTHON" - <<'PY' 2>&1
import importlib, platform, sys
print("python", sys.version.split()[0], platform.platform())
for name in ("numpy", "cupy", "torch", "cudnn", "nvmath", "cuda.bindings", "cuda.core",
             "mpi4py", "h5py"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", type(exc).__name__, exc)
try:
    import cupy
    print("cuda devices:", cupy.cuda.runtime.getDeviceCount(),
          "runtime", cupy.cuda.runtime.runtimeGetVersion())
except Exception as exc:
    print("cupy cuda:", type(exc).__name__, exc)
from purine_mpi.gpu import blas
print("cuBLAS binding:", blas.blas_backend(), blas.blas_note() or "(capturable)")
PY
} > "$OUT/env.txt"

if "$PYTHON" -c 'import mpi4py' 2>/dev/null; then
  # two ranks must see each other: a wheel that cannot find libmpi runs singletons
  scripts="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
  mpiexec="$scripts/mpiexec"
  [ -x "$mpiexec" ] || mpiexec="$(command -v mpiexec || echo mpiexec)"
  timeout 300 "$mpiexec" -n 2 "$PYTHON" -c 'import sys
from mpi4py import MPI
world = MPI.COMM_WORLD
print("rank", world.Get_rank(), "of", world.Get_size(), MPI.Get_library_version().splitlines()[0])
sys.exit(0 if world.Get_size() == 2 else 1)' > "$OUT/mpi_check.txt" 2>&1
  step mpi_check $?
fi

if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs --junitxml="$OUT/pytest_gpu.xml" \
      $PYTEST_ARGS tests > "$OUT/pytest_gpu.txt" 2>&1
  step pytest_gpu $?
fi

if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
  "$PYTHON" benchmarks/gpu_throughput.py $BENCH_ARGS \
      > "$OUT/gpu_throughput.json" 2> "$OUT/gpu_throughput.log"
  step gpu_throughput $?
  if "$PYTHON" -c 'import mpi4py' 2>/dev/null; then
    : > "$OUT/gpu_dp.json"
    for n in 1 2; do
      timeout 600 "$mpiexec" -n "$n" "$PYTHON" -m purine_mpi bench jobs/cifar10_quick.yaml \
          --set device=0 --iters 50 --json 2>> "$OUT/gpu_throughput.log" | tail -n 1 \
          >> "$OUT/gpu_dp.json"
      step "gpu_dp_np$n" "${PIPESTATUS[0]}"
    done
  fi
fi

cat "$OUT/status.txt" 2>/dev/null
exit "$status"
