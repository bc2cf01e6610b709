#!/usr/bin/env bash
# Every GPU step of purine_mpi, in stages, on a GPU machine without internet
# (wheels are carried in, never downloaded there):
#
#   benchmarks/gpu_session.sh fetch        where pip reaches PyPI: download the wheels
#   benchmarks/gpu_session.sh --plan       the stages in the order of `all`: budgets,
#                                          seconds measured on an H200, the calls they need
#   benchmarks/gpu_session.sh STAGE...     on the GPU machine, from the repository root:
#                                          the stages in the order given, in one call
#   benchmarks/gpu_session.sh all          every stage, the most valuable first, as many
#                                          as fit one call (CALL_BUDGET_S, default 590 s)
#
# Each start of a lent GPU machine costs part of a short lease (about 30 s
# each of six starts on an H200, 2026-11-25; 15 minutes of device time in all,
# 600 s a command), so run the stages together in as few calls as fit:
# `--plan` says which, and which of them fit one session's device time (the
# budgets of all stages do not: they need two sessions). The runner gives each stage its budget or what is left of the
# call's, whichever is less, and skips a stage with under 20 s left (said in
# summary.txt). Stages (each stops itself at its budget, so its reports always
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
#   bench       240 s  gpu_throughput.py, each config and batch in its own run
#                      (cifar10_quick and NIN at 128, then at 512), torch.compile
#                      included: images/s and peak memory against PyTorch's
#                                                 -> bench_<config>_<batch>.json
#   dp           45 s  bench --json of cifar10_quick on 1 rank and 2 ranks
#                      (parallel.backend mpi), then 2 ranks with auto (on one GPU:
#                      mpi, comm_backend_note says why)            -> gpu_dp.json
#   plans        30 s  benchmarks/cudnn_plans.py: every cuDNN plan of two convolutions
#                      against a float64 reference, and the plan the set-up chose
#                                                         -> cudnn_plans.json
#   gpt         265 s  bf16 against PyTorch autocast: gpu_throughput.py --precision bf16
#                      (cifar10_quick and NIN at batch 128, channels-last, eager and
#                      whole-step CUDA graph; 40 s at most) -> bench_bf16.json, then
#                      benchmarks/gpt_gpu.py, jobs/gpt2_124m.yaml with precision bf16
#                      (16 x 1024 tokens a step; ours also with PURINE_FC_EPILOGUE=
#                      cublaslt) against nanoGPT's model in PyTorch, eager and
#                      torch.compile, interleaved  -> gpt_gpu.json (its deadline
#                      leaves the stage's last 110 s to the microbenchmarks, which
#                      run after it and cannot starve it); then
#                      benchmarks/loss_kernel_gpu.py (30 s at most): the GPT loss
#                      kernels, vectorized against the old    -> loss_kernel_gpu.json;
#                      benchmarks/bias_gelu_gpu.py (25 s at most): the bias and
#                      GELU kernels, vectorized against the old -> bias_gelu_gpu.json;
#                      benchmarks/layernorm_kernel_gpu.py (20 s at most): the
#                      layer-norm kernels, warp per row against block per row
#                                                         -> layernorm_kernel_gpu.json
#                      benchmarks/adam_copy_gpu.py (15 s at most): the fused AdamW
#                      update writing the bf16 weight copies against the update
#                      then a Cast per copy               -> adam_copy_gpu.json
#   learn       575 s  benchmarks/learn_gpu.py, issue 45's learning target: a BPE on
#                      the machine's stdlib, the unigram cross-entropy, gpt2_124m
#                      bf16 then fp32 for the same iterations in the time given
#                      (an estimate: it uses what it is given; `--plan` cuts it to
#                      what is left of a session after `tests gpt`)
#                                     -> learn.json, learn_*_metrics.jsonl, logs
#
# Every stage first installs what is missing from the pinned wheels
# (benchmarks/gpu_wheels.txt, the one list `fetch` downloads) from $WHEELS
# (default ./wheels; the device tool carries it when named in `carry`), into
# the interpreter's own site-packages -- never --target: there mpi4py does
# not find mpich's libmpi and every rank runs alone. A package the image
# already has is kept (its cuda-* packages are never overwritten); then
# `pip check`. The stages write under $WORK (default ./gpu_session_work):
#   env.txt             nvidia-smi, architecture, python, pip list, pip check,
#                       the cuDNN version, the cuBLAS binding (each stage adds its own)
#   install.log         what was installed and what was kept
#   cache/              the cuDNN plan cache (PURINE_CACHE_DIR; our compiled
#                       kernels under cache/kernels) and CuPy's kernel cache
#   probe.txt/.json     the probe's lines
#   status.txt          "<stage> <step> <exit status>" for every step
#   stages.txt          "<stage> ok|failed(rc)|killed(SIG)|skipped(...) <seconds>" a stage
#   (and each stage's reports, above). $OUT (default ./gpu_session_out; the
#   device tool's $OUT, which hands back at most 8 files) gets two files,
#   rewritten after every stage and when the call is killed (TERM, INT, HUP):
#   gpu_session.tgz     all of $WORK but cache/ (tar xzf gpu_session.tgz)
#   summary.txt         each stage's status and seconds, each step's exit
#                       status, the failed and the GPU-only tests, the headline
#                       figures of every report (benchmarks/gpu_session_summary.py)
#   A later call on the same machine adds to $WORK: its archive holds both.
# Knobs: PYTHON (default python3), PYTEST_ARGS, BENCH_ARGS (extra
# gpu_throughput.py arguments), FETCH_PYTHON_VERSION (default: the pins
# file's python-version), STAGE_BUDGET_S (a stage's budget in seconds instead
# of the plan's: the tests, on a loaded CPU-only machine, where the probe
# stage's install + env.txt + probe took over its 60 s), CALL_BUDGET_S (a
# call's seconds, default 590), DEVICE_BUDGET_S and START_S (`--plan` only:
# a session's device time, default 900, and a machine start's, default 30),
# WORK, OUT. The exit status is the first
# failing stage's (124 where a stage was skipped for want of time).
set -u

# stage  budget_s  what (the --plan table)
PLAN="probe|60|install the carried wheels, then the assumptions, PASS/FAIL each (gpu_probe.py, under a minute)
tests|120|pytest -m gpu (cuDNN SDPA fwd/bwd against float64: tests/test_sdpa.py; the cuBLASLt epilogue, fp32/fp64 and bf16: tests/test_gpu_fc_epilogue.py, tests/test_gpu_fc_lt_bf16.py; kernels without flush to zero: tests/test_gpu_kernel_options.py and the bf16 copy kernels' adversarial tests; the vectorized loss kernels: tests/test_gpu_loss_vec.py)
bench-quick|45|cifar10_quick, batch 128, against PyTorch eager and CUDA graph
bench|240|fp32 images/s and peak memory against PyTorch (issue 44's memory target): cifar10_quick 128, nin_cifar10 128, cifar10_quick 512, nin_cifar10 512, torch.compile too
dp|45|bench on 1 and 2 ranks (MPI), 2 ranks with backend auto
plans|30|every cuDNN plan's deviation from a float64 reference (cudnn_plans.py)
gpt|265|bf16: both CNNs against autocast, GPT-2 124M (also with PURINE_FC_EPILOGUE=cublaslt) against PyTorch eager and compile; the loss kernels, new against old (loss_kernel_gpu.py); the bias and GELU kernels, new against old (bias_gelu_gpu.py); the layer-norm kernels, warp per row against block per row (layernorm_kernel_gpu.py); AdamW writing the bf16 weight copies against the update then a Cast each (adam_copy_gpu.py)
learn|575|issue 45's learning target (learn_gpu.py; a call of its own, its budget an estimate: it uses what it is given): a BPE of 50257 on 8 MB of the machine's stdlib *.py, the unigram entropy, gpt2_124m bf16 then fp32 (16 x 1024 tokens a step, the same iterations, the time shared 35/65): bf16 below the entropy within 600 s, bf16 - fp32 within 0.05 nats"

# the order of `all`, the most valuable first (issue 45's GPT-2 and loss
# kernels and the GPU-only tests, its learning target, then issue 44's memory target; the probe's
# assumptions passed on every H200 so far)
ALL_ORDER="tests gpt learn bench probe bench-quick dp plans"

# stage|seconds it took on an H200|when and how measured (what `--plan` and
# `all` say; summary.txt records each stage's seconds anew)
MEASURED="probe|25|2026-11-25, install included
tests|48|2026-11-30, 12 workers: pytest 31 s, the rest install and env.txt, by env.txt's stamps
bench-quick|15|2026-11-25
bench|150+|2026-11-29 and 11-30: cut at its 150 s budget before nin_cifar10 finished
dp|8|2026-11-25
plans|30?|2026-11-29, not timed alone: a 216 s call of probe plans dp bench, less the others
gpt|105|2026-11-30: a 153 s call of tests gpt, less tests' 48 s (bench_bf16 and gpt_gpu only: the microbenchmarks' 90 s came after)
learn|575?|an estimate, its budget: not yet run on a GPU"

# a call's own limit: stages stop (each at its budget, or earlier where
# the call's time runs out) so that the call ends before the device tool's
# 600 s and packs what it has
CALL_BUDGET_S="${CALL_BUDGET_S:-590}"

usage() {
  echo "usage: $0 --plan | fetch | all | STAGE... (stages: $ALL_ORDER)" >&2
  exit 2
}
[ $# -ge 1 ] || usage
budget() { echo "$PLAN" | awk -F'|' -v s="$1" '$1 == s { print $2 }'; }
measured() { echo "$MEASURED" | awk -F'|' -v s="$1" '$1 == s { print $2 " s (" $3 ")" }'; }
whole_seconds() {  # whole_seconds NAME VALUE: VALUE, or exit 2 naming NAME
  case "$2" in
    *[!0-9]*|0*|"") echo "$0: $1 must be a whole number of seconds (> 0), not '$2'" >&2
        exit 2 ;;
  esac
}

plan_table() {  # the stages in the order of `all`: budget, time measured, what;
  # then the calls they need (each call's budgets within CALL_BUDGET_S)
  local stage total=0 call="" call_s=0 calls=()
  echo "stage        budget  measured on an H200; what"
  for stage in $ALL_ORDER; do
    printf '%-12s %5ss  %s; %s\n' "$stage" "$(budget "$stage")" "$(measured "$stage")" \
        "$(echo "$PLAN" | awk -F'|' -v s="$stage" '$1 == s { print $3 }')"
    total=$((total + $(budget "$stage")))
    if [ -n "$call" ] && [ $((call_s + $(budget "$stage"))) -gt "$CALL_BUDGET_S" ]; then
      calls+=("$call"); call=""; call_s=0
    fi
    call="${call:+$call }$stage"; call_s=$((call_s + $(budget "$stage")))
  done
  calls+=("$call")
  printf '%-12s %5ss  (%s min of budgets; a call has %s s)\n' total "$total" \
      $((total / 60)) "$CALL_BUDGET_S"
  echo "calls (the budgets of each within ${CALL_BUDGET_S} s; \`all\` runs what fits and packs):"
  for call in "${calls[@]}"; do echo "  benchmarks/gpu_session.sh $call"; done
  # the sessions: a session's device time (DEVICE_BUDGET_S) pays a machine
  # start (START_S), every call's budgets and HANDBACK_S for the transfers
  # and the hand-back (give_back, or the idle wait before the machine goes
  # back); a call that does not fit goes to the next session -- but for
  # `learn` alone, which uses what it is given: it gets what is left where
  # that is at least LEARN_MIN_S (an estimate: the BPE, start-up and
  # compilation, and bf16 to its crossing, not yet run on a GPU)
  local handback_s=30 learn_min_s=300 used=0 n=0 line="" cb left
  echo "sessions (${DEVICE_BUDGET_S} s of device time each: a machine start, ${START_S} s;" \
      "the calls' budgets; ${handback_s} s for the transfers and the hand-back):"
  for call in "${calls[@]}"; do
    cb=0; for stage in $call; do cb=$((cb + $(budget "$stage"))); done
    left=$((DEVICE_BUDGET_S - used - handback_s))
    if [ -n "$line" ] && [ "$cb" -gt "$left" ] && [ "$call" = learn ] &&
        [ "$left" -ge "$learn_min_s" ]; then
      line="$line, then CALL_BUDGET_S=$left benchmarks/gpu_session.sh learn (cut from"
      line="$line $cb s: it uses what it is given; where the calls before took less, the"
      line="$line device tool's budget_left_s less $((handback_s + 10)), up to $CALL_BUDGET_S)"
      used=$((used + left)); continue
    fi
    if [ -z "$line" ] || [ "$cb" -gt "$left" ]; then
      [ -z "$line" ] || echo "  session $n ($((used + handback_s)) s$([ $((used + handback_s)) \
          -le "$DEVICE_BUDGET_S" ] || echo ": over ${DEVICE_BUDGET_S} s, cut it with CALL_BUDGET_S")): $line"
      n=$((n + 1)); used=$START_S; line=""
    fi
    line="${line:+$line, then }benchmarks/gpu_session.sh $call"; used=$((used + cb))
  done
  echo "  session $n ($((used + handback_s)) s$([ $((used + handback_s)) -le "$DEVICE_BUDGET_S" ] ||
      echo ": over ${DEVICE_BUDGET_S} s, cut it with CALL_BUDGET_S")): $line"
}

if [ "$1" = --plan ]; then
  [ $# -eq 1 ] || usage
  whole_seconds CALL_BUDGET_S "$CALL_BUDGET_S"
  DEVICE_BUDGET_S="${DEVICE_BUDGET_S:-900}"; START_S="${START_S:-30}"
  whole_seconds DEVICE_BUDGET_S "$DEVICE_BUDGET_S"; whole_seconds START_S "$START_S"
  plan_table
  exit 0
fi

if [ "$1" != fetch ] && [ "$1" != --stage ]; then
  # the runner: the stages given (or all), in order, each a child process
  # writing into $WORK; after each, $WORK (less its caches) packed into
  # $OUT/gpu_session.tgz and summarized in $OUT/summary.txt -- the only
  # two files in $OUT, so a device tool that hands back a few files gets
  # everything, and a call killed at its limit still leaves the stages done
  if [ "$1" = all ]; then
    [ $# -eq 1 ] || usage
    # shellcheck disable=SC2086  # one stage per word
    set -- $ALL_ORDER
  fi
  for stage in "$@"; do [ -n "$(budget "$stage")" ] || usage; done
  [ -z "${STAGE_BUDGET_S:-}" ] || whole_seconds STAGE_BUDGET_S "$STAGE_BUDGET_S"
  whole_seconds CALL_BUDGET_S "$CALL_BUDGET_S"
  REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  OUT="${OUT:-$REPO/gpu_session_out}"
  WORK="${WORK:-$REPO/gpu_session_work}"
  PYTHON="${PYTHON:-python3}"
  mkdir -p "$OUT" "$WORK" || exit 2
  OUT="$(cd "$OUT" && pwd)"; WORK="$(cd "$WORK" && pwd)"
  case "$WORK/" in
    "$OUT"/*) echo "$0: WORK ($WORK) must not be inside OUT ($OUT): OUT holds the archive only" >&2
        exit 2 ;;
  esac
  call_start=$(date +%s)
  echo "== call $(date -u '+%F %T') UTC: $*" >> "$WORK/stages.txt"
  pack() {  # summary.txt, then the archive: each written aside, then moved in
    { "$PYTHON" "$REPO/benchmarks/gpu_session_summary.py" "$WORK" 2>> "$WORK/pack.log" ||
        python3 "$REPO/benchmarks/gpu_session_summary.py" "$WORK" 2>> "$WORK/pack.log" ||
        cat "$WORK/stages.txt" "$WORK/status.txt" 2>/dev/null; } > "$WORK/summary.txt"
    tar czf "$OUT/gpu_session.tgz.part" -C "$WORK" --exclude=./cache --exclude='*.part' . \
        2>> "$WORK/pack.log" && mv -f "$OUT/gpu_session.tgz.part" "$OUT/gpu_session.tgz"
    cp "$WORK/summary.txt" "$OUT/summary.txt.part" && mv -f "$OUT/summary.txt.part" "$OUT/summary.txt"
  }
  child=""
  # shellcheck disable=SC2329  # (called by the traps below)
  on_signal() {  # the call killed: end the stage, say so, pack what there is
    trap '' TERM INT HUP
    if [ -n "$child" ]; then
      kill -TERM "$child" 2>/dev/null; wait "$child"
      echo "$stage killed($1) $(( $(date +%s) - stage_start ))" >> "$WORK/stages.txt"
    else  # while packing after a stage (recorded already), or before the first
      echo "call killed($1) between stages (after ${stage:-none})" >> "$WORK/stages.txt"
    fi
    pack
    exit 143
  }
  trap 'on_signal TERM' TERM; trap 'on_signal INT' INT; trap 'on_signal HUP' HUP
  first=0
  for stage in "$@"; do
    left_s=$(( CALL_BUDGET_S - ($(date +%s) - call_start) ))
    stage_budget=${STAGE_BUDGET_S:-$(budget "$stage")}
    if [ "$left_s" -lt 20 ]; then
      echo "$stage skipped(call-budget) 0 (${left_s} s of CALL_BUDGET_S=$CALL_BUDGET_S left)" \
          >> "$WORK/stages.txt"
      [ "$first" -ne 0 ] || first=124
      pack
      continue
    fi
    [ "$stage_budget" -le "$left_s" ] || stage_budget=$left_s
    stage_start=$(date +%s)
    OUT="$WORK" STAGE_BUDGET_S="$stage_budget" bash "${BASH_SOURCE[0]}" --stage "$stage" &
    child=$!
    wait "$child"
    rc=$?
    child=""
    echo "$stage $([ "$rc" -eq 0 ] && echo ok || echo "failed($rc)") $(( $(date +%s) - stage_start ))" \
        "(budget ${stage_budget} s)" >> "$WORK/stages.txt"
    [ "$first" -ne 0 ] || first=$rc
    pack
  done
  exit "$first"
fi
if [ "$1" = --stage ]; then shift; [ $# -eq 1 ] || usage; fi
MODE="$1"
[ "$MODE" = fetch ] || [ -n "$(budget "$MODE")" ] || usage
case "${STAGE_BUDGET_S:-}" in
  "") stage_budget=$(budget "$MODE") ;;   # (empty for fetch)
  *) whole_seconds STAGE_BUDGET_S "$STAGE_BUDGET_S"; stage_budget=$STAGE_BUDGET_S ;;
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
limited=""
limit_s() {  # limit_s SECONDS COMMAND...: the command, stopped after SECONDS (at most
  # what is left of the stage's budget); in the background, so that a TERM to
  # the stage (the runner's, when the call is killed) reaches it at once: GNU
  # timeout runs its command in a process group of its own, which a TERM to
  # the call's group misses, and bash runs a trap only once a foreground
  # command has ended (a step with a timeout of its own held a killed call
  # for up to 40 s). Never in a pipeline: there $limited is a subshell's.
  local l rc; l=$1; shift
  [ "$l" -le "$(left)" ] || l=$(left)
  [ "$l" -gt 1 ] || l=1
  timeout --kill-after=5 "$l" "$@" &
  limited=$!
  wait "$limited"; rc=$?
  limited=""
  return "$rc"
}
limit() { limit_s "$(left)" "$@"; }   # the command, stopped at the stage's budget
trap '[ -z "$limited" ] || kill -TERM "$limited" 2>/dev/null; exit 143' TERM

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
  limit env -u PIP_TARGET -u PIP_PREFIX "$PYTHON" -m pip install "${flags[@]}" $missing \
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
    # where pytest-xdist is installed (the GPU image has it): a worker per
    # core, at most 12 (each holds a CUDA context, ~0.5 GiB of the GPU); on
    # an H200's 16 cores 12 workers ran the 319 GPU tests in 37 s (2026-11-29)
    workers=()
    if "$PYTHON" -c 'import xdist' 2>/dev/null; then
      n=$(nproc 2>/dev/null || echo 4); [ "$n" -le 12 ] || n=12
      workers=(-n "$n")
    fi
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
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
    # batch 128 of both first: issue 44's memory target is b128, b512 and NIN
    for batch in 128 512; do
      for config in cifar10_quick nin_cifar10; do
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
      # shellcheck disable=SC2086  # ranks, backend
      set -- $run
      # (into a file, then its last line: limit in a pipeline could not be ended)
      limit "$mpiexec" -n "$1" "$PYTHON" -m purine_mpi bench jobs/cifar10_quick.yaml \
          --set device=0 --set parallel.backend="$2" --iters 50 --json \
          > "$OUT/gpu_dp.stdout" 2>> "$OUT/gpu_dp.log"
      rc=$?
      tail -n 1 "$OUT/gpu_dp.stdout" >> "$OUT/gpu_dp.json"
      rm -f "$OUT/gpu_dp.stdout"
      step "dp_np$1_$2" "$rc"
    done ;;
  plans)
    limit "$PYTHON" benchmarks/cudnn_plans.py > "$OUT/cudnn_plans.json" 2> "$OUT/cudnn_plans.log"
    step cudnn_plans $? ;;
  gpt)
    # the headline (gpt_gpu.py) first after the short bf16 bench, the kernel
    # microbenchmarks after it in the stage's last micro_s seconds (their caps
    # + 5 s each to be killed): they cannot starve it. A new microbenchmark
    # adds its cap here and to the stage's budget in PLAN.
    micro_s=$(( (30 + 5) + (25 + 5) + (20 + 5) + (15 + 5) ))
    # shellcheck disable=SC2086
    limit_s 40 "$PYTHON" benchmarks/gpu_throughput.py \
        --configs jobs/cifar10_quick.yaml jobs/nin_cifar10.yaml --batches 128 --iters 30 \
        --warmup 5 --no-compile --precision bf16 $BENCH_ARGS \
        > "$OUT/bench_bf16.json" 2> "$OUT/bench_bf16.log"
    step gpu_throughput_bf16 $?
    # the rounds after the first, and the profiles, stop 20 s before its deadline,
    # micro_s before the stage's end (its JSON comes back); a profile of ours begins
    # only where it fits before the deadline
    # ours with PURINE_FC_EPILOGUE=cublaslt beside the default, interleaved in the
    # same run (purine_fc_cublaslt_vs_purine: the biased fc outputs as one cuBLASLt
    # product each, the bias rounded to bf16 in its epilogue; docs/gpu.md, "Precision");
    # each side of ours reports its own peak (less what was in use when it began) and
    # device_memory: what was in use before it, what it left, its arena, scratch,
    # capture pools, cuBLAS workspaces and cuBLASLt plans (the summary prints them)
    # (a stage cut short, STAGE_BUDGET_S or the call's end, leaving it under 60 s
    # that way: all that is left, the microbenchmarks skipped)
    deadline=$(( $(left) - micro_s ))
    [ "$deadline" -ge 60 ] || deadline=$(left)
    limit "$PYTHON" benchmarks/gpt_gpu.py --iters 10 --warmup 3 --rounds 2 \
        --sides purine purine_fc_cublaslt torch_eager torch_compile \
        --budget-s $(( deadline > 21 ? deadline - 20 : 1 )) --deadline-s "$deadline" \
        > "$OUT/gpt_gpu.json" 2> "$OUT/gpt_gpu.log"
    step gpt_gpu $?
    micro() {  # micro NAME CAP BUDGET ARGS...: benchmarks/NAME.py, stopped after
      # CAP s or at the stage's end (its rounds after the first stop BUDGET s in,
      # less where the stage's end cuts CAP); skipped (124) under 10 s left
      local name=$1 cap=$2 budget=$3 l rc; shift 3; l=$(( $(left) - 5 ))
      if [ "$l" -lt 10 ]; then step "$name" 124; return; fi
      if [ "$l" -lt "$cap" ]; then budget=$(( budget - (cap - l) )); cap=$l; fi
      [ "$budget" -ge 1 ] || budget=1
      # (in the background, as limit's: a TERM to the stage reaches it at once)
      timeout --kill-after=5 "$cap" "$PYTHON" "benchmarks/$name.py" --budget-s "$budget" "$@" \
          > "$OUT/$name.json" 2> "$OUT/$name.log" &
      limited=$!
      wait "$limited"; rc=$?
      limited=""
      step "$name" "$rc"
    }
    # the GPT loss kernels, vectorized against the ones before them, on
    # 16384 x 50304 float32 logits (ms, GB/s, fraction of 4.8 TB/s; under 30 s)
    micro loss_kernel_gpu 30 15
    # the bias and GELU kernels, vectorized against the ones before them, at
    # GPT-2's shapes (ms, GB/s, fraction of 4.8 TB/s, bitwise agreement; under 25 s)
    micro bias_gelu_gpu 25 10
    # the layer-norm kernels, a warp per row against the block per row before
    # them, on 16384 x 768 (GPT-2's activations: ms, GB/s, fraction of 4.8 TB/s,
    # the outputs' agreement; under 20 s)
    micro layernorm_kernel_gpu 20 10
    # the fused AdamW update writing GPT-2's bf16 weight copies in its pass
    # against the update then a Cast kernel per copy (ms, launches, GB/s,
    # bitwise agreement; under 15 s)
    micro adam_copy_gpu 15 6
    ;;
  learn)
    # issue 45's learning target (benchmarks/learn_gpu.py; docs/gpu.md, "The
    # learning target"): the corpus from this machine's stdlib, its BPE, the
    # unigram entropy, then gpt2_124m bf16 and fp32 for the same iterations,
    # the time left shared 35/65 (a run still going at its share is stopped,
    # its metrics kept) -> learn.json, learn_*_metrics.jsonl and logs. Its
    # corpus, token file and runs lie under cache/ (left out of the archive);
    # it ends on its own 5 s before the stage's budget
    limit "$PYTHON" benchmarks/learn_gpu.py --work "$OUT/cache/learn" --report-dir "$OUT" \
        --budget-s $(( $(left) > 10 ? $(left) - 5 : 5 )) > "$OUT/learn.log" 2>&1
    step learn_gpu $? ;;
esac

grep "^$MODE " "$OUT/status.txt" 2>/dev/null
exit "$status"
