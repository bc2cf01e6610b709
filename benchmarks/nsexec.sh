#!/bin/sh
# Stand-in for ssh that MPICH's hydra calls as its launcher
# (mpiexec -launcher ssh -launcher-exec benchmarks/nsexec.sh -hosts A,B ...):
# runs the command inside the network namespace that owns address "host".
# Hydra calls it as: nsexec.sh [options] host command...; options are skipped.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F) shift 2 ;;   # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
for ns in $(ip netns list | cut -d' ' -f1); do
  if ip -n "$ns" -4 -o addr show | grep -q " $host/"; then
    exec ip netns exec "$ns" /bin/sh -c "$*"
  fi
done
echo "nsexec.sh: no network namespace has address $host" >&2
exit 1
