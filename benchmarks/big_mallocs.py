"""The allocations of 128 KiB or more that a rank made after memory.json's
baseline and still holds after the last iteration, by call stack: a
malloc shim (C, compiled here with ``cc`` into OUT, loaded with
LD_PRELOAD) keeps the live ones with their stacks from the baseline on
(train/trainer.py) and writes them at the loop's end (train/loop.py), on
every rank of benchmarks/rss_vs_plan.py's run of the case (the same
``plan`` and ``train`` commands). NumPy's arrays appear as calls from
``_multiarray_umath``; the rest are the C libraries' own (MPICH's
object blocks, HDF5's, OpenBLAS's), which neither tracemalloc nor
``plan`` sees. The attribution of docs/running.md ("Will it fit?",
gpt_tiny's tensor rank 0):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/big_mallocs.py \\
        --out /tmp/big --iters 3 --cases gpt_tiny:tensor

Prints, per case and rank, MiB by the first three frames outside the
shim (library and offset: ``addr2line -f -e LIB OFFSET`` names the
function where the library has symbols). Linux and glibc only (the
shim calls ``__libc_malloc`` and friends).

Internally (``--as-purine``) it is ``python -m purine_mpi`` with the two
reads hooked in.
"""
import argparse
import collections
import ctypes
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import rss_vs_plan  # noqa: E402

SHIM = r"""
#define _GNU_SOURCE
#include <stddef.h>
#include <string.h>
#include <execinfo.h>
#include <fcntl.h>
#include <unistd.h>
#include <stdio.h>
#include <pthread.h>
extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
#define BIG (128 * 1024)
#define N 16384
#define D 12
static struct { void *p; size_t n; int depth; void *bt[D]; int after; } live[N];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int inside;
static int after;
static void add(void *p, size_t n) {
    if (!p || n < BIG || inside) return;
    inside = 1;
    void *bt[D]; int d = backtrace(bt, D);
    pthread_mutex_lock(&mu);
    for (int i = 0; i < N; i++) if (!live[i].p) {
        live[i].p = p; live[i].n = n; live[i].depth = d;
        memcpy(live[i].bt, bt, sizeof bt); live[i].after = after; break; }
    pthread_mutex_unlock(&mu);
    inside = 0;
}
static void del(void *p) {
    if (!p) return;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < N; i++) if (live[i].p == p) { live[i].p = 0; break; }
    pthread_mutex_unlock(&mu);
}
__attribute__((constructor)) static void init(void) {
    void *b[2]; inside = 1; backtrace(b, 2); inside = 0; }
void *malloc(size_t n) { void *p = __libc_malloc(n); add(p, n); return p; }
void *calloc(size_t a, size_t b) { void *p = __libc_calloc(a, b); add(p, a * b); return p; }
void *realloc(void *q, size_t n) { del(q); void *p = __libc_realloc(q, n); add(p, n); return p; }
void free(void *p) { del(p); __libc_free(p); }
void shim_mark(void) { pthread_mutex_lock(&mu); after = 1; pthread_mutex_unlock(&mu); }
void shim_dump(const char *path) {
    inside = 1;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pthread_mutex_lock(&mu);
    for (int i = 0; i < N; i++) if (live[i].p && live[i].after) {
        char line[64]; int k = snprintf(line, sizeof line, "ALLOC %zu\n", live[i].n);
        if (write(fd, line, k) != k) break;
        backtrace_symbols_fd(live[i].bt, live[i].depth, fd);
    }
    pthread_mutex_unlock(&mu);
    close(fd);
    inside = 0;
}
"""


def build(out):
    """Compile the shim into OUT/big_mallocs.so; its path."""
    src, lib = os.path.join(out, "big_mallocs.c"), os.path.join(out, "big_mallocs.so")
    with open(src, "w") as f:
        f.write(SHIM)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", lib, src, "-lpthread"], check=True)
    return lib


def as_purine(out, lib):
    """``python -m purine_mpi ARGS`` with the shim marked at the baseline
    and its live allocations written at the loop's end
    (rss_vs_plan.run_hooked)."""
    shim = ctypes.CDLL(lib)
    rss_vs_plan.run_hooked(shim.shim_mark, lambda rank: shim.shim_dump(
        os.path.join(out, f"big-rank{rank}.txt").encode()))


def by_stack(path, frames=3):
    """{the first ``frames`` frames outside the shim: bytes} of a dump."""
    out = collections.Counter()
    with open(path) as f:
        blocks = f.read().split("ALLOC ")[1:]
    for b in blocks:
        lines = b.splitlines()
        stack = [re.sub(r"\[0x[0-9a-f]+\]$", "", line).strip() for line in lines[1:]
                 if "big_mallocs.so" not in line]
        out[" | ".join(os.path.basename(s) for s in stack[:frames])] += int(lines[0])
    return out


def main():
    if len(sys.argv) > 3 and sys.argv[1] == "--as-purine":
        out, lib = sys.argv[2], sys.argv[3]
        sys.argv = [sys.argv[0]] + sys.argv[4:]
        return as_purine(out, lib)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/big_mallocs")
    ap.add_argument("--cases", default="gpt_tiny:tensor")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lib = build(args.out)
    cases = rss_vs_plan.hooked_cases(
        args.cases, args.out, "big",
        lambda where: [sys.executable, os.path.abspath(__file__), "--as-purine", where, lib],
        "big-rank{}.txt", iters=args.iters, env={"LD_PRELOAD": lib})
    for case, res, ranks in cases:
        if "error" in res:
            print(f"{case}: {res['error']}")
            continue
        for r, p, m, path in ranks:
            stacks = by_stack(path)
            print(f"{case} rank {r}: planned {p / 2**20:.1f} MiB, peak {m / 2**20:.1f}, "
                  f"live allocations of 128 KiB or more since the baseline "
                  f"{sum(stacks.values()) / 2**20:.2f}")
            for stack, n in stacks.most_common(10):
                print(f"    {n / 2**20:8.3f}  {stack}")


if __name__ == "__main__":
    main()
