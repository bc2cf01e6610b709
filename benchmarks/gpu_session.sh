#!/usr/bin/env bash
# Every GPU step of purine_mpi, in stages, on a GPU machine without internet
# (wheels are carried in, never downloaded there):
#
#   benchmarks/gpu_session.sh fetch        where pip reaches PyPI: download the wheels
#   benchmarks/gpu_session.sh --plan       the stages, their time budgets, in order
#   benchmarks/gpu_session.sh STAGE...     on the GPU machine, from the repository root:
#                                          the stages in the order given, in one call
#   benchmarks/gpu_session.sh all          every stage, in the plan's order
#
# Each start of a lent GPU machine costs part of a short lease (about 30 s
# each of six starts on an H200, 2026-11-25), so run the stages together in one call:
# the budgets below sum to 10 minutes, one command's limit; the stages took
# 25 s (probe), 25-40 s (tests, 4 workers), 15 s (bench-quick) and 8 s (dp)
# on an H200. Stages (each stops itself at its budget, so its reports always
# come back):
#   probe        60 s  the first install of the wheels (later stages find them), then
#                      benchmarks/gpu_probe.py: PASS/FAIL for each assumption the
#                      GPU path rests on (interpreter, wheels, pip check, nvmath
#                      capture, cuDNN inside a capture, pinned cudaMemcpyAsync
#                      replay, the abort of a failed capture, MPI world size 2)
#   tests       120 s  python -m pytest -m gpu (a worker per core, at most 12,
#                      where pytest-xdist is installed)                      -> pytest_gpu.txt, .xml
#   bench-quick  45 s  gpu_throughput.py, cifar10_quick at batch 128, no
#                      torch.compile: the first figures  -> bench_quick.json
#   bench       150 s  gpu_throughput.py, each config and batch (128, 512) in its
#                      own run, torch.compile included    -> bench_<config>_<batch>.json
#   dp           45 s  bench --json of cifar10_quick on 1 rank and 2 ranks
#                      (parallel.backend mpi), then 2 ranks with auto (on one GPU:
#                      mpi, comm_backend_note says why)            -> gpu_dp.json
#   plans        30 s  benchmarks/cudnn_plans.py: every cuDNN plan of two convolutions
#                      against a float64 reference, and the plan the set-up chose
#                                                         -> cudnn_plans.json
#   gpt         150 s  bf16 against PyTorch autocast: gpu_throughput.py --precision bf16
#                      (cifar10_quick and NIN at batch 128, channels-last, eager and
#                      whole-step CUDA graph; 40 s at most) -> bench_bf16.json, then
#                      benchmarks/gpt_gpu.py, jobs/gpt2_124m.yaml with precision bf16
#                      (16 x 1024 tokens a step; ours also with PURINE_FC_EPILOGUE=
#                      cublaslt) against nanoGPT's model in PyTorch, eager and
#                      torch.compile, interleaved  -> gpt_gpu.json; before it
#                      benchmarks/loss_kernel_gpu.py (30 s at most): the GPT loss
#                      kernels, vectorized against the old    -> loss_kernel_gpu.json
#                      and benchmarks/layernorm_kernel_gpu.py (20 s at most): the
#                      layer-norm kernels, warp per row against block per row
#                                                         -> layernorm_kernel_gpu.json
#
# Every stage first installs what is missing from the pinned wheels
# (benchmarks/gpu_wheels.txt, the one list `fetch` downloads) from $WHEELS
# (default ./wheels; the device tool carries it when named in `carry`), into
# the interpreter's own site-packages -- never --target: there mpi4py does
# not find mpich's libmpi and every rank runs alone. A package the image
# already has is kept (its cuda-* packages are never overwritten); then
# `pip check`. Everything goes under $OUT (default ./gpu_session_out):
#   env.txt             nvidia-smi, architecture, python, pip list, pip check,
#                       the cuDNN version, the cuBLAS binding (each stage adds its own)
#   install.log         what was installed and what was kept
#   cache/              the cuDNN plan cache (PURINE_CACHE_DIR) and CuPy's kernel
#                       cache: they come back with the reports
#   probe.txt/.json     the probe's lines
#   status.txt          "<stage> <step> <exit status>" for every step
#   (about 17 files and the cache folder: where a batch system or a lent
#   machine hands back only a few files, write them elsewhere and archive
#   them in one: OUT=/tmp/gs benchmarks/gpu_session.sh all; tar czf
#   RESULTS/gpu_session.tgz -C /tmp/gs --exclude=cache .)
# Knobs: PYTHON (default python3), PYTEST_ARGS, BENCH_ARGS (extra
# gpu_throughput.py arguments), FETCH_PYTHON_VERSION (default: the pins
# file's python-version), STAGE_BUDGET_S (a stage's budget in seconds instead
# of the plan's: the tests, on a loaded CPU-only machine, where the probe
# stage's install + env.txt + probe took over its 60 s). The exit status is
# the first failing step's.
set -u

# stage  budget_s  what (the --plan table; the budgets sum to at most 600 s)
PLAN="probe|60|install the carried wheels, then the assumptions, PASS/FAIL each (gpu_probe.py, under a minute)
tests|120|pytest -m gpu (cuDNN SDPA fwd/bwd against float64: tests/test_sdpa.py; the cuBLASLt epilogue, fp32/fp64 and bf16: tests/test_gpu_fc_epilogue.py, tests/test_gpu_fc_lt_bf16.py)
bench-quick|45|cifar10_quick, batch 128, against PyTorch eager and CUDA graph
bench|150|both configs, batches 128 and 512, torch.compile too
dp|45|bench on 1 and 2 ranks (MPI), 2 ranks with backend auto
plans|30|every cuDNN plan's deviation from a float64 reference (cudnn_plans.py)
gpt|150|bf16: both CNNs against autocast, GPT-2 124M (also with PURINE_FC_EPILOGUE=cublaslt) against PyTorch eager and compile; the loss and layer-norm kernels, new against old (loss_kernel_gpu.py, layernorm_kernel_gpu.py)"

usage() {
  echo "usage: $0 --plan | fetch | all | STAGE... (stages: probe tests bench-quick bench dp plans gpt)" >&2
  exit 2
}
[ $# -ge 1 ] || usage
budget() { echo "$PLAN" | awk -F'|' -v s="$1" '$1 == s { print $2 }'; }
if [ $# -gt 1 ] || [ "$1" = all ]; then   # several stages in one call, in order
  if [ "$1" = all ]; then
    [ $# -eq 1 ] || usage
    set -- $(echo "$PLAN" | cut -d'|' -f1)
  fi
  for stage in "$@"; do [ -n "$(budget "$stage")" ] || usage; done
  first=0
  for stage in "$@"; do
    bash "${BASH_SOURCE[0]}" "$stage"
    rc=$?
    [ "$first" -ne 0 ] || first=$rc
  done
  exit "$first"
fi
MODE="$1"

if [ "$MODE" = --plan ]; then
  total=0
  echo "stage        budget  what"
  while IFS='|' read -r stage secs what; do
    printf '%-12s %5ss  %s\n' "$stage" "$secs" "$what"
    total=$((total + secs))
  done <<< "$PLAN"
  printf '%-12s %5ss  (%s min: all of them fit one 600 s command)\n' total "$total" $((total / 60))
  exit 0
fi
[ "$MODE" = fetch ] || [ -n "$(budget "$MODE")" ] || usage
case "${STAGE_BUDGET_S:-}" in
  "") stage_budget=$(budget "$MODE") ;;   # (empty for fetch)
  *[!0-9]*|0*) echo "$0: STAGE_BUDGET_S must be a whole number of seconds (> 0), not '$STAGE_BUDGET_S'" >&2
      exit 2 ;;
  *) stage_budget=$STAGE_BUDGET_S ;;
esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
PINS="$REPO/benchmarks/gpu_wheels.txt"
OUT="${OUT:-$REPO/gpu_session_out}"
WHEELS="${WHEELS:-$REPO/wheels}"
PYTHON="${PYTHON:-python3}"
PYTEST_ARGS="${PYTEST_ARGS:-}"
BENCH_ARGS="${BENCH_ARGS:-}"
pinned() { grep -v '^[[:space:]]*#' "$PINS" | grep '=='; }

if [ "$MODE" = fetch ]; then
  version="${FETCH_PYTHON_VERSION:-$(sed -n 's/.*python-version: *\([0-9.]*\).*/\1/p' "$PINS")}"
  mkdir -p "$WHEELS"
  # exactly the pins, without dependencies (the pins name what the image may lack)
  # shellcheck disable=SC2046
  exec "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$version" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
      -d "$WHEELS" $(pinned)
fi

mkdir -p "$OUT/cache"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PURINE_CACHE_DIR="$OUT/cache" CUPY_CACHE_DIR="$OUT/cache/cupy"
status=0
step() {  # step NAME RC: record a step's exit status, keep the first failure
  echo "$MODE $1 $2" >> "$OUT/status.txt"
  if [ "$2" -ne 0 ] && [ "$status" -eq 0 ]; then status="$2"; fi
}
STAGE_END=$(( $(date +%s) + stage_budget - 5 ))
left() { echo $(( STAGE_END - $(date +%s) )); }   # seconds left of this stage's budget
limit() { local l; l=$(left); [ "$l" -gt 1 ] || l=1; timeout --kill-after=5 "$l" "$@"; }

# -- install: the pins the interpreter lacks, from the carried wheels (idempotent);
# those named "no-deps" in the pins file without their dependencies
install_list() {  # install_list deps|nodeps: the missing pins of that kind
  "$PYTHON" - "$PINS" "$1" 2>> "$OUT/install.log" <<'PY'
import sys
from importlib import metadata
sys.path.insert(0, "benchmarks")
from gpu_probe import pins
wanted, _, nodeps = pins(sys.argv[1])
for name, version in wanted.items():
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        if (name.lower() in nodeps) == (sys.argv[2] == "nodeps"):
            print(f"{name}=={version}")
        continue
    if sys.argv[2] == "deps":
        print(f"kept the image's {have} for {name}=={version}", file=sys.stderr)
PY
}
for kind in deps nodeps; do
  missing="$(install_list "$kind")"
  [ -n "$missing" ] || continue
  flags=(--no-index --find-links "$WHEELS")
  [ "$kind" = nodeps ] && flags+=(--no-deps)
  # shellcheck disable=SC2086  # one pin per word
  env -u PIP_TARGET -u PIP_PREFIX "$PYTHON" -m pip install "${flags[@]}" $missing \
      >> "$OUT/install.log" 2>&1
  step "install_$kind" $?
done

{
  echo "== $MODE $(date -u)"
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  echo "machine: $(uname -m) $(uname -r)"
  "$PYTHON" - <<'PY' 2>&1
import importlib, platform, sys
print("python", sys.version.split()[0], platform.platform())
for name in ("numpy", "cupy", "torch", "cudnn", "nvmath", "cuda.bindings", "cuda.core",
             "mpi4py", "h5py", "yaml", "pytest"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", type(exc).__name__, exc)
try:
    import cupy
    for d in range(cupy.cuda.runtime.getDeviceCount()):
        props = cupy.cuda.runtime.getDeviceProperties(d)
        print(f"cuda device {d}: {props['name']}, sm_{cupy.cuda.Device(d).compute_capability}")
    print("CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "driver", cupy.cuda.runtime.driverGetVersion())
except Exception as exc:
    print("cupy cuda:", type(exc).__name__, exc)
try:
    import cudnn
    print("cuDNN (frontend backend_version)", cudnn.backend_version())
except Exception as exc:
    print("cuDNN frontend:", type(exc).__name__, exc)
try:
    import torch
    print("cuDNN (torch)", torch.backends.cudnn.version(), "torch cuda", torch.version.cuda)
except Exception as exc:
    print("torch:", type(exc).__name__, exc)
from purine_mpi.gpu import blas
print("cuBLAS binding:", blas.blas_backend(), blas.blas_note() or "(capturable)")
PY
  echo "-- pip list"; "$PYTHON" -m pip list 2>&1
  echo "-- pip check"; "$PYTHON" -m pip check 2>&1
} >> "$OUT/env.txt"

scripts="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
mpiexec="$scripts/mpiexec"
[ -x "$mpiexec" ] || mpiexec="$(command -v mpiexec || echo mpiexec)"

case "$MODE" in
  probe)
    limit "$PYTHON" benchmarks/gpu_probe.py --out "$OUT"
    step probe $? ;;
  tests)
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
    # where pytest-xdist is installed (the GPU image has it): a worker per
    # core, at most 12 (each holds a CUDA context, ~0.5 GiB of the GPU); on
    # an H200's 16 cores 12 workers ran the 319 GPU tests in 37 s (2026-11-29)
    workers=()
    if "$PYTHON" -c 'import xdist' 2>/dev/null; then
      n=$(nproc 2>/dev/null || echo 4); [ "$n" -le 12 ] || n=12
      workers=(-n "$n")
    fi
    limit "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs "${workers[@]}" \
        --junitxml="$OUT/pytest_gpu.xml" $PYTEST_ARGS tests > "$OUT/pytest_gpu.txt" 2>&1
    step pytest_gpu $? ;;
  bench-quick)
    # shellcheck disable=SC2086
    limit "$PYTHON" benchmarks/gpu_throughput.py --configs jobs/cifar10_quick.yaml \
        --batches 128 --iters 30 --warmup 5 --no-compile $BENCH_ARGS \
        > "$OUT/bench_quick.json" 2> "$OUT/bench_quick.log"
    step gpu_throughput $? ;;
  bench)
    for config in cifar10_quick nin_cifar10; do
      for batch in 128 512; do
        [ "$(left)" -gt 30 ] || { step "${config}_$batch" 124; continue; }
        # shellcheck disable=SC2086
        limit "$PYTHON" benchmarks/gpu_throughput.py --configs "jobs/$config.yaml" \
            --batches "$batch" --iters 50 --warmup 5 $BENCH_ARGS \
            > "$OUT/bench_${config}_$batch.json" 2> "$OUT/bench_${config}_$batch.log"
        step "${config}_$batch" $?
      done
    done ;;
  dp)
    : > "$OUT/gpu_dp.json"
    # (one GPU: 2 ranks share it, so auto must fall back to MPI and say why)
    for run in "1 mpi" "2 mpi" "2 auto"; do
      set -- $run
      limit "$mpiexec" -n "$1" "$PYTHON" -m purine_mpi bench jobs/cifar10_quick.yaml \
          --set device=0 --set parallel.backend="$2" --iters 50 --json \
          2>> "$OUT/gpu_dp.log" | tail -n 1 >> "$OUT/gpu_dp.json"
      step "dp_np$1_$2" "${PIPESTATUS[0]}"
    done ;;
  plans)
    limit "$PYTHON" benchmarks/cudnn_plans.py > "$OUT/cudnn_plans.json" 2> "$OUT/cudnn_plans.log"
    step cudnn_plans $? ;;
  gpt)
    # shellcheck disable=SC2086
    timeout --kill-after=5 40 "$PYTHON" benchmarks/gpu_throughput.py \
        --configs jobs/cifar10_quick.yaml jobs/nin_cifar10.yaml --batches 128 --iters 30 \
        --warmup 5 --no-compile --precision bf16 $BENCH_ARGS \
        > "$OUT/bench_bf16.json" 2> "$OUT/bench_bf16.log"
    step gpu_throughput_bf16 $?
    # the GPT loss kernels, vectorized against the ones before them, on
    # 16384 x 50304 float32 logits (ms, GB/s, fraction of 4.8 TB/s; under 30 s)
    timeout --kill-after=5 30 "$PYTHON" benchmarks/loss_kernel_gpu.py --budget-s 15 \
        > "$OUT/loss_kernel_gpu.json" 2> "$OUT/loss_kernel_gpu.log"
    step loss_kernel_gpu $?
    # the layer-norm kernels, a warp per row against the block per row before
    # them, on 16384 x 768 (GPT-2's activations: ms, GB/s, fraction of 4.8 TB/s,
    # the outputs' agreement; under 20 s)
    timeout --kill-after=5 20 "$PYTHON" benchmarks/layernorm_kernel_gpu.py --budget-s 10 \
        > "$OUT/layernorm_kernel_gpu.json" 2> "$OUT/layernorm_kernel_gpu.log"
    step layernorm_kernel_gpu $?
    # the rounds after the first, and the profiles, stop 20 s before the stage's end
    # (its JSON comes back); a profile of ours begins only where it fits before the end
    # ours with PURINE_FC_EPILOGUE=cublaslt beside the default, interleaved in the
    # same run (purine_fc_cublaslt_vs_purine: the biased fc outputs as one cuBLASLt
    # product each, the bias rounded to bf16 in its epilogue; docs/gpu.md, "Precision")
    limit "$PYTHON" benchmarks/gpt_gpu.py --iters 10 --warmup 3 --rounds 2 \
        --sides purine purine_fc_cublaslt torch_eager torch_compile \
        --budget-s $(( $(left) - 20 )) --deadline-s "$(left)" \
        > "$OUT/gpt_gpu.json" 2> "$OUT/gpt_gpu.log"
    step gpt_gpu $? ;;
esac

grep "^$MODE " "$OUT/status.txt" 2>/dev/null
exit "$status"
