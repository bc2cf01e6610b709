#!/bin/bash
# The two entry points under mpiexec -n 2 (purine-mpi script vs python -m purine_mpi),
# interleaved pairs, on an idle machine and with one core kept busy by a spinning
# shell loop; the thread variables unset, so each rank decides its own threads
# (purine_mpi/threads.py). Prints one JSON object (images/s of each run).
#   bash benchmarks/entry_points.sh [PAIRS] [JOB]
set -u
PAIRS=${1:-3}
JOB=${2:-jobs/cifar10_quick.yaml}
cd "$(dirname "$0")/.."
unset OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS PURINE_THREADS
ips() { "$@" bench "$JOB" --iters 10 --warmup 2 --json 2>/dev/null |
        python -c "import sys, json; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['images_per_s'])"; }
out="{\"job\": \"$JOB\""
for cond in idle busy; do
  spin=""
  if [ "$cond" = busy ]; then sh -c 'while :; do :; done' & spin=$!; sleep 1; fi
  script=(); module=()
  for _ in $(seq "$PAIRS"); do
    script+=("$(ips mpiexec -n 2 purine-mpi)")
    module+=("$(ips mpiexec -n 2 python -m purine_mpi)")
  done
  [ -n "$spin" ] && kill "$spin"
  out="$out, \"$cond\": {\"script\": [$(IFS=,; echo "${script[*]}")], \"module\": [$(IFS=,; echo "${module[*]}")]}"
done
echo "$out}"
