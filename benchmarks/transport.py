"""One-sided against two-sided transfers (issue 34): per message, per
reduction, and whole jobs, side by side. Prints one JSON object.

    python benchmarks/transport.py [--sizes-kib 64,256,1024,4096,16384]
        [--reps 20] [--best-of 5] [--reduce-mib 1,4,16] [--jobs]
        [--job-iters 20] [--job-rounds 3]

``messages`` (``mpiexec -n 2`` of itself): for each size, a ping-pong of
float32 messages (rank 0 -> rank 1, then rank 1 -> rank 0; the time of one
message is the round trip / 2, so every message counts only once it is
complete at its receiver, flow control included) by

    send_recv   ``Send`` / ``Recv``
    put         ``Put`` into the peer's ``Win.Allocate`` window, ``Lock_all``
                once for the whole run, ``Flush``, then a notify: an
                ``Accumulate`` (SUM) of 1 into the peer's counter word and a
                ``Flush``; the receiver polls its own counter word
                (``Win.Sync`` and a load: the unified memory model)
    shared      a store (NumPy copy) into the peer's segment of a
                ``Win.Allocate_shared`` window, ``Win.Sync``, then the
                counter word in the peer's segment is raised; the receiver
                polls it (``Win.Sync`` and a load)

The three run in interleaved rounds (send_recv, put, shared, send_recv, ...);
each figure is the best round of ``--best-of``, each round ``--reps``
round trips after a barrier. ``speedup_put`` / ``speedup_shared``:
send_recv's time / theirs.

``reduce``: the sum of one float32 buffer per rank over 2 ranks, every rank
ending with the sum, by ``Allreduce`` (in place) against a shared-window
reduction (each rank's buffer lives in its segment of one
``Allocate_shared`` window; after a barrier each rank adds its half of the
elements over both segments into a result window, a barrier, and
``shared_copy_out`` adds each rank's copy of the whole result into its own
buffer, as the data-parallel path would need; ``shared_in_window`` leaves the
result in the window). Interleaved, best of ``--best-of``.
``winner``: the faster of ``allreduce`` and ``shared_copy_out`` per size.

``jobs`` (with ``--jobs``): whole jobs through ``python -m purine_mpi bench
--json`` with ``--set parallel.transport=two_sided`` and ``one_sided``,
interleaved (two_sided, one_sided, two_sided, ...) ``--job-rounds`` times,
the median images/s of each and their ratio: the 2-stage pipeline of
jobs/digits_pipeline.yaml (2 ranks), a 2-stage pipeline with a 1,024-wide fc
at its stage boundary (2 ranks), sync_ps on benchmarks/cifar10_quick_wide.yaml
(3 ranks: 2 workers, 1 server; also the server's communication time per
iteration, ``server_comm_ms_per_iter`` of bench --json), and data
parallelism on jobs/cifar10_quick.yaml (2 ranks: MPI's allreduce against
the sum through a shared window, parallel/dp_windows.py). A run that fails
(a transport this build does not have) gives its error line instead.
One BLAS thread per rank.

``--two-hosts 1gbit`` (root): the message figures (send_recv and put; no
shared window across hosts, no reduction) with one rank in each of two
network namespaces, overlap_netns.py's set-up, MPICH over UCX's TCP.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def one_thread_env():
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def mpiexec():
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return path if os.path.exists(path) else "mpiexec"


# ------------------------------------------------------------ worker side
def _wait_counter(win, counter, target, comm=None):
    """Poll a counter word of this rank's own window until it reaches
    ``target`` (Win.Sync makes remote updates visible: unified model).
    ``comm``: also drive MPI's progress engine (an Iprobe) while polling, as
    a library that emulates RMA with messages (over TCP) needs the target
    to."""
    while True:
        win.Sync()
        if counter[0] >= target:
            return
        if comm is not None:
            comm.Iprobe()


def time_messages(comm, nbytes, reps, best_of, shared_window=True):
    """{method: seconds per message} for one message size (best round);
    without ``shared_window`` (ranks on two hosts) no shared-window store."""
    import numpy as np
    from mpi4py import MPI
    rank, peer = comm.rank, 1 - comm.rank
    n = max(1, nbytes // 4)
    src = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    dst = np.empty(n, np.float32)
    # a Win.Allocate window: the data, then one int64 counter word
    item = 4
    win = MPI.Win.Allocate(n * item + 8, 1, comm=comm)
    mem = np.frombuffer(win.tomemory(), np.uint8)
    data_rma = mem[:n * item].view(np.float32)
    count_rma = mem[n * item:n * item + 8].view(np.int64)
    count_rma[0] = 0
    one = np.ones(1, np.int64)
    # a shared window: each rank's segment holds its data and counter
    shm = MPI.Win.Allocate_shared(n * item + 8, 1, comm=comm) if shared_window else None
    seg = {}
    for r in ((0, 1) if shared_window else ()):
        buf, _ = shm.Shared_query(r)
        raw = np.frombuffer(buf, np.uint8)
        seg[r] = (raw[:n * item].view(np.float32), raw[n * item:n * item + 8].view(np.int64))
    if shared_window:
        seg[rank][1][0] = 0
    progress = None if shared_window else comm  # across hosts: drive progress
    comm.Barrier()
    win.Lock_all()
    if shared_window:
        shm.Lock_all()
    state = {"put": 0, "shared": 0}

    def send_recv():
        for _ in range(reps):
            if rank == 0:
                comm.Send(src, dest=peer, tag=7)
                comm.Recv(dst, source=peer, tag=7)
            else:
                comm.Recv(dst, source=peer, tag=7)
                comm.Send(src, dest=peer, tag=7)

    def put_one():
        win.Put(src, peer, target=0)
        win.Flush(peer)
        win.Accumulate(one, peer, target=n * item, op=MPI.SUM)
        win.Flush(peer)

    def put():
        for _ in range(reps):
            state["put"] += 1
            if rank == 0:
                put_one()
                _wait_counter(win, count_rma, state["put"], progress)
            else:
                _wait_counter(win, count_rma, state["put"], progress)
                put_one()

    def shared_one():
        data, counter = seg[peer]
        data[...] = src
        shm.Sync()
        counter[0] += 1  # only this rank writes the peer's counter
        shm.Sync()

    def shared():
        for _ in range(reps):
            state["shared"] += 1
            if rank == 0:
                shared_one()
                _wait_counter(shm, seg[rank][1], state["shared"])
            else:
                _wait_counter(shm, seg[rank][1], state["shared"])
                shared_one()

    methods = {"send_recv": send_recv, "put": put}
    if shared_window:
        methods["shared"] = shared
    best = {m: float("inf") for m in methods}
    try:
        for _ in range(best_of):
            for name, fn in methods.items():
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                dt = comm.allreduce(dt, op=MPI.MAX)
                best[name] = min(best[name], dt / (2 * reps))
        # the data arrived whole: the last message into each rank
        ok = bool(np.array_equal(data_rma, np.random.default_rng(peer).standard_normal(n)
                                 .astype(np.float32)))
        ok = comm.allreduce(ok, op=MPI.LAND)
    finally:
        win.Unlock_all()
        win.Free()
        if shared_window:
            shm.Unlock_all()
            shm.Free()
    return best, ok


def time_reduce(comm, nbytes, best_of, reps=5):
    """{method: seconds per reduction} of one float32 buffer of ``nbytes``."""
    import numpy as np
    from mpi4py import MPI
    rank, size = comm.rank, comm.size
    n = max(size, nbytes // 4)
    grad = np.random.default_rng(rank + 10).standard_normal(n).astype(np.float32)
    local = grad.copy()
    shm = MPI.Win.Allocate_shared(n * 4, 4, comm=comm)
    res = MPI.Win.Allocate_shared(n * 4 if rank == 0 else 0, 4, comm=comm)
    segs = [np.frombuffer(shm.Shared_query(r)[0], np.float32) for r in range(size)]
    out = np.frombuffer(res.Shared_query(0)[0], np.float32)
    bounds = [n * r // size for r in range(size + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]

    def allreduce():
        for _ in range(reps):
            local[...] = grad
            comm.Allreduce(MPI.IN_PLACE, local, op=MPI.SUM)

    def shared(copy_out):
        def run():
            for _ in range(reps):
                segs[rank][...] = grad  # the gradient, as the backward pass writes it
                shm.Sync()
                comm.Barrier()
                np.add(segs[0][lo:hi], segs[1][lo:hi], out=out[lo:hi])
                for r in range(2, size):
                    out[lo:hi] += segs[r][lo:hi]
                res.Sync()
                comm.Barrier()
                if copy_out:
                    local[...] = out
        return run

    methods = {"allreduce": allreduce, "shared_copy_out": shared(True),
               "shared_in_window": shared(False)}
    best = {m: float("inf") for m in methods}
    shm.Lock_all()
    res.Lock_all()
    try:
        for _ in range(best_of):
            for name, fn in methods.items():
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                best[name] = min(best[name], dt / reps)
        expect = sum(np.random.default_rng(r + 10).standard_normal(n).astype(np.float32)
                     for r in range(size))
        ok = comm.allreduce(bool(np.allclose(out, expect, rtol=1e-5, atol=1e-5)), op=MPI.LAND)
    finally:
        shm.Unlock_all()
        res.Unlock_all()
        shm.Free()
        res.Free()
    return best, ok


def worker(args):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    out = {"messages": [], "reduce": []}
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.size == comm.size
    node.Free()
    for kib in args.sizes_kib:
        best, ok = time_messages(comm, kib * 1024, args.reps, args.best_of, one_node)
        row = {"bytes": kib * 1024, "correct": ok}
        row.update({f"{m}_ms": round(t * 1000, 6) for m, t in best.items()})
        for m in ("put", "shared"):
            if m in best:
                # three significant digits: a ratio far below 1 (a put slowed by a
                # busy machine) keeps its figure instead of rounding to 0.005
                row[f"speedup_{m}"] = float(f"{best['send_recv'] / best[m]:.3g}")
        out["messages"].append(row)
    for mib in (args.reduce_mib if one_node else ()):
        best, ok = time_reduce(comm, int(mib * 1024 * 1024), args.best_of)
        row = {"bytes": int(mib * 1024 * 1024), "correct": ok}
        row.update({f"{m}_ms": round(t * 1000, 6) for m, t in best.items()})
        row["winner"] = ("shared_copy_out" if best["shared_copy_out"] < best["allreduce"]
                         else "allreduce")
        out["reduce"].append(row)
    if comm.rank == 0:
        print(json.dumps(out), flush=True)


def run_micro(args, launch=(), env=None):
    cmd = [*launch, mpiexec(), *(["-launcher", "ssh", "-launcher-exec",
                                  os.path.join(HERE, "nsexec.sh"), "-hosts", args.hosts]
                                 if launch else []), "-n", "2", sys.executable, os.path.abspath(__file__), "--worker",
           "--sizes-kib", ",".join(str(k) for k in args.sizes_kib), "--reps", str(args.reps),
           "--best-of", str(args.best_of),
           "--reduce-mib", ",".join(str(m) for m in args.reduce_mib)]
    res = subprocess.run(cmd, env=env or one_thread_env(), capture_output=True, text=True,
                         cwd=ROOT, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"transport.py: the 2-rank run failed ({res.returncode}):\n"
                         f"{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------ whole jobs
def wide_pipeline_config(path, iters):
    """A 2-stage pipeline whose stage boundary is a 1,024-wide fc."""
    import yaml
    net = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 1024},
           {"type": "relu", "name": "relu1", "bottom": "fc1", "top": "fc1"},
           {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 1024},
           {"type": "relu", "name": "relu2", "bottom": "fc2", "top": "fc2"},
           {"type": "fc", "name": "fc3", "bottom": "fc2", "top": "fc3", "num_output": 10},
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc3", "label"], "top": "loss"}]
    stages = {"fc1": 0, "relu1": 0, "fc2": 1, "relu2": 1, "fc3": 1, "loss": 1}
    cfg = {"name": "pipeline_wide_boundary", "seed": 1,
           "data": {"train": {"source": "synthetic", "shape": [256], "classes": 10,
                              "batch_size": 256, "num_samples": 2048}},
           "net": net, "solver": {"base_lr": 0.01, "max_iter": iters, "display": 0},
           "parallel": {"scheme": "pipeline", "stages": stages, "micro_batches": 4}}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def bench_once(config, ranks, transport, iters, extra=()):
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "purine_mpi", "bench", config,
           "--json", "--iters", str(iters), "--set", f"parallel.transport={transport}",
           *extra]
    res = subprocess.run(cmd, env=one_thread_env(), capture_output=True, text=True, cwd=ROOT,
                         timeout=900)
    if res.returncode != 0:
        lines = [x for x in (res.stderr or res.stdout).strip().splitlines() if x.strip()]
        return {"error": lines[-1] if lines else f"exit {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def compare_job(name, config, ranks, iters, rounds, extra=()):
    runs = {"two_sided": [], "one_sided": []}
    for _ in range(rounds):
        for transport in runs:
            runs[transport].append(bench_once(config, ranks, transport, iters, extra))
    row = {"job": name, "ranks": ranks}
    for transport, results in runs.items():
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            row[transport] = {"error": errors[0]}
            continue
        row[transport] = {
            "images_per_s": statistics.median(r["images_per_s"] for r in results),
            "transport": results[0].get("transport"),
            **{k: _median_or_none(r.get(k) for r in results)
               for k in ("server_comm_ms_per_iter", "server_comm_in_flight_ms_per_iter",
                         "server_send_ms_per_iter", "server_recv_ms_per_iter")},
            "bytes_copied_per_iter": results[0].get("bytes_copied_per_iter"),
            "server_bytes_copied_per_iter": results[0].get("server_bytes_copied_per_iter"),
            "bytes_one_sided_per_iter": results[0].get("bytes_one_sided_per_iter"),
            "bytes_two_sided_per_iter": results[0].get("bytes_two_sided_per_iter"),
        }
    one, two = row["one_sided"], row["two_sided"]
    if "error" not in one and "error" not in two:
        row["images_per_s_ratio"] = round(one["images_per_s"] / two["images_per_s"], 3)
        a, b = one["server_comm_ms_per_iter"], two["server_comm_ms_per_iter"]
        if a is not None and b:
            row["server_comm_ratio"] = round(a / b, 3)
    return row


def _median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_jobs(args, tmp):
    wide = wide_pipeline_config(os.path.join(tmp, "pipeline_wide.yaml"), 100)
    digits = os.path.join(tmp, "digits.h5")  # the pipeline job's data (bench reads its shapes)
    subprocess.run([sys.executable, "-m", "purine_mpi", "data", "digits", "--out", digits],
                   env=one_thread_env(), cwd=ROOT, check=True, capture_output=True)
    return [
        compare_job("digits_pipeline", os.path.join(ROOT, "jobs", "digits_pipeline.yaml"), 2,
                    args.job_iters, args.job_rounds,
                    ("--set", f"data.train.path={digits}", "--set", f"data.test.path={digits}")),
        compare_job("pipeline_fc1024_boundary", wide, 2, args.job_iters, args.job_rounds),
        compare_job("data_parallel_cifar10_quick", os.path.join(ROOT, "jobs",
                                                                "cifar10_quick.yaml"), 2,
                    args.job_iters, args.job_rounds),
        compare_job("sync_ps_cifar10_quick_wide",
                    os.path.join(ROOT, "benchmarks", "cifar10_quick_wide.yaml"), 3,
                    args.job_iters, args.job_rounds,
                    ("--set", "parallel.mode=sync_ps", "--set", "parallel.ps_ranks=1")),
    ]


def run_two_hosts(args):
    """The message figures with one rank in each of two network namespaces
    joined by a veth pair shaped to ``args.two_hosts`` (overlap_netns.py's
    set-up; root), MPICH over UCX's TCP transport."""
    sys.path.insert(0, HERE)
    import overlap_netns
    if os.geteuid() != 0 or not all(overlap_netns.shutil.which(t) for t in ("ip", "tc")):
        raise SystemExit("transport.py --two-hosts needs root with the ip and tc tools")
    names, addresses, made = overlap_netns.make_hosts(2, "rma", args.two_hosts)
    env = dict(one_thread_env(), MPIR_CVAR_CH4_NETMOD="ucx", UCX_TLS="tcp,self",
               UCX_NET_DEVICES="pmveth", MPIR_CVAR_NOLOCAL="1")
    args.hosts = ",".join(addresses)
    args.reduce_mib = []
    try:
        out = run_micro(args, launch=("ip", "netns", "exec", names[0]), env=env)
    finally:
        overlap_netns.teardown_netns(*made)
    out["two_hosts"] = {"rate": args.two_hosts, "transport": "MPICH ch4:ucx, UCX_TLS=tcp,self"}
    return out


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def _floats(text):
    return [float(x) for x in text.split(",") if x]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-kib", type=_ints, default=[64, 256, 1024, 4096, 16384])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--best-of", type=int, default=5)
    ap.add_argument("--reduce-mib", type=_floats, default=[1, 4, 16])
    ap.add_argument("--jobs", action="store_true", help="also whole jobs (minutes)")
    ap.add_argument("--job-iters", type=int, default=20)
    ap.add_argument("--job-rounds", type=int, default=3)
    ap.add_argument("--two-hosts", metavar="RATE", help="the message figures across two "
                    "emulated hosts (network namespaces, each link end shaped to RATE, e.g. "
                    "1gbit; needs root) instead of one node")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    import tempfile
    if args.two_hosts:
        return print(json.dumps(run_two_hosts(args), indent=1))
    out = run_micro(args)
    if args.jobs:
        with tempfile.TemporaryDirectory() as tmp:
            out["jobs"] = run_jobs(args, tmp)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
