#!/usr/bin/env bash
# Every GPU step of purine_mpi in one script, for a machine with a CUDA GPU
# (and no internet: wheels are carried in, not downloaded).
#
#   benchmarks/gpu_session.sh [all|tests|bench]        (default: all)
#
# from the repository root. Writes into $OUT (default: ./gpu_session_out):
#   env.txt               nvidia-smi, python and package versions
#   pip_install.log       the carried wheels installed (if any)
#   pytest_gpu.txt        python -m pytest -m gpu (+ pytest_gpu.xml, JUnit)
#   gpu_throughput.json   benchmarks/gpu_throughput.py's report (one JSON object)
#   gpu_throughput.log    its standard error (cuDNN / capture notes)
#   status.txt            the exit status of each step
#
# Wheels: every *.whl in $WHEELS (default: ./wheels, e.g. nvidia-cudnn-frontend
# fetched elsewhere with `pip download --no-deps nvidia-cudnn-frontend`) is
# installed with --no-index --no-deps first. Knobs: PYTHON (default python3),
# BENCH_ARGS (default: both configs, batches 128 and 512, 50 iterations),
# PYTEST_ARGS (extra pytest arguments). The exit status is the first failing
# step's, 0 when every step passed.
set -u

MODE="${1:-all}"
case "$MODE" in
  all|tests|bench) ;;
  *) echo "usage: $0 [all|tests|bench]" >&2; exit 2 ;;
esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT="${OUT:-$REPO/gpu_session_out}"
WHEELS="${WHEELS:-$REPO/wheels}"
PYTHON="${PYTHON:-python3}"
BENCH_ARGS="${BENCH_ARGS:---batches 128 512 --iters 50 --warmup 5}"
PYTEST_ARGS="${PYTEST_ARGS:-}"
mkdir -p "$OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
status=0

step() {  # step NAME RC: record a step's exit status, keep the first failure
  echo "$1 $2" >> "$OUT/status.txt"
  if [ "$2" -ne 0 ] && [ "$status" -eq 0 ]; then status="$2"; fi
}

{
  date -u
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  "$PYTHON" - <<'PY' 2>&1
import importlib, platform, sys
print("python", sys.version.split()[0], platform.platform())
for name in ("numpy", "cupy", "torch", "cudnn", "mpi4py", "h5py"):
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
PY
} > "$OUT/env.txt"

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ "${#wheels[@]}" -gt 0 ]; then
  "$PYTHON" -m pip install --no-index --no-deps "${wheels[@]}" > "$OUT/pip_install.log" 2>&1
  step pip_install $?
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
fi

cat "$OUT/status.txt" 2>/dev/null
exit "$status"
