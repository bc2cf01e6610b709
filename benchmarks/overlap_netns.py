"""Does communication hide behind computation? Two ranks on two emulated
hosts (network namespaces joined by a veth pair, each end shaped to
1 Gbit/s with tbf), synchronous data parallelism with bucketed Allreduce.

    sudo .venv/bin/python benchmarks/overlap_netns.py [--config CONFIG.yaml]
        [--iters 5] [--warmup 2] [--rate 1gbit] [--bucket-mb 4] [--hosts 2]

With ``--hosts N`` (N > 2) the N namespaces hang off a bridge in one more
namespace, each by a veth pair shaped with tbf at both ends (the host's
sending and receiving side), one rank per host.

Needs root (ip netns, tc) and MPICH with UCX (the PyPI ``mpich`` wheel). It
creates namespaces ``pmbenchA<pid>`` / ``pmbenchB<pid>`` (10.251.<k>.1/.2),
launches one rank in each through hydra with benchmarks/nsexec.sh as the
"ssh", forces TCP (UCX_TLS=tcp,self, else MPICH would use shared memory),
and deletes the namespaces afterwards. Per iteration (median over
``--iters`` after ``--warmup``, each iteration timed from the end of the one
before), both ranks running at once:

    compute_ms   the single-replica training graph, no communication
    comm_ms      only the Allreduce ops of the composed graph's buckets
    real_ms      the composed graph: gradients reduced during backward, and
                 (unless --no-defer) the last allreduces and updates
                 finishing while the next iteration's forward runs
    hidden_ms    compute_ms + comm_ms - real_ms (communication that overlapped)
    cpu_ms       CPU time of a rank's process (all threads, user + system)
                 per iteration in each of the three runs: what the transfer
                 itself costs the cores that also compute

and ``comm_overlap``: the share of communication time during which compute
ops ran (from the dispatcher's trace, as ``bench --json``). Prints one JSON
object. The default net (conv layers below a 25 MB fully connected layer)
makes compute and communication comparable at 1 Gbit/s.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

DEFAULT_NET = {
    "name": "overlap_net", "seed": 0,
    "data": {"train": {"source": "synthetic", "shape": [3, 32, 32], "classes": 10,
                       "num_samples": 256, "batch_size": 32}},
    "net": [
        {"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1", "num_output": 32,
         "kernel": 5, "pad": 2},
        {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
        {"type": "pool", "name": "pool1", "bottom": "conv1", "top": "pool1", "pool": "max",
         "kernel": 2, "stride": 2},
        {"type": "conv", "name": "conv2", "bottom": "pool1", "top": "conv2", "num_output": 64,
         "kernel": 5, "pad": 2},
        {"type": "relu", "name": "relu2", "bottom": "conv2", "top": "conv2"},
        {"type": "pool", "name": "pool2", "bottom": "conv2", "top": "pool2", "pool": "max",
         "kernel": 2, "stride": 2},
        {"type": "fc", "name": "fc1", "bottom": "pool2", "top": "fc1", "num_output": 1536},
        {"type": "relu", "name": "relu3", "bottom": "fc1", "top": "fc1"},
        {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 10},
        {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss"},
    ],
    "solver": {"base_lr": 0.001, "momentum": 0.9, "lr_policy": "fixed", "max_iter": 100,
               "display": 0, "test_interval": 0},
    "parallel": {"scheme": "data", "mode": "sync"},
}


# ------------------------------------------------------------------ driver
def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def setup_netns(a, b, subnet, rate):
    sh("ip", "netns", "add", a)
    sh("ip", "netns", "add", b)
    # both ends get one name, so one UCX_NET_DEVICES value serves both ranks
    sh("ip", "link", "add", "pmtmpA", "netns", a, "type", "veth", "peer", "name", "pmtmpB",
       "netns", b)
    for ns, old, host in ((a, "pmtmpA", 1), (b, "pmtmpB", 2)):
        sh("ip", "-n", ns, "link", "set", old, "name", "pmveth")
        sh("ip", "-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", "pmveth")
        sh("ip", "-n", ns, "link", "set", "pmveth", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        if rate:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "pmveth", "root", "tbf",
               "rate", rate, "burst", "256kb", "latency", "100ms")
    # UCX ignores a link without carrier: wait until both ends report UP
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = [sh("ip", "-n", ns, "-o", "link", "show", "pmveth").stdout for ns in (a, b)]
        if all("state UP" in s and "NO-CARRIER" not in s for s in states):
            return
        time.sleep(0.05)
    raise RuntimeError("the veth link between the namespaces did not come up")


def setup_bridge(hosts, bridge, subnet, rate):
    """``hosts`` namespaces (subnet.1, .2, ...) joined by a bridge in
    namespace ``bridge``; each host's link shaped to ``rate`` both ways."""
    sh("ip", "netns", "add", bridge)
    sh("ip", "-n", bridge, "link", "add", "pmbr", "type", "bridge")
    sh("ip", "-n", bridge, "link", "set", "pmbr", "up")
    for i, ns in enumerate(hosts):
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", f"pmtmp{i}", "netns", ns, "type", "veth", "peer", "name",
           f"pmport{i}", "netns", bridge)
        sh("ip", "-n", ns, "link", "set", f"pmtmp{i}", "name", "pmveth")
        sh("ip", "-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", "pmveth")
        sh("ip", "-n", ns, "link", "set", "pmveth", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", bridge, "link", "set", f"pmport{i}", "master", "pmbr")
        sh("ip", "-n", bridge, "link", "set", f"pmport{i}", "up")
        if rate:
            for where, dev in ((ns, "pmveth"), (bridge, f"pmport{i}")):
                sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", rate, "burst", "256kb", "latency", "100ms")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = [sh("ip", "-n", ns, "-o", "link", "show", "pmveth").stdout for ns in hosts]
        if all("state UP" in s and "NO-CARRIER" not in s for s in states):
            return
        time.sleep(0.05)
    raise RuntimeError("the veth links to the bridge did not come up")


def make_hosts(count, tag, rate):
    """(namespaces, [addresses], every namespace to delete) of ``count``
    emulated hosts: a veth pair for 2, a bridge for more."""
    pid = os.getpid()
    names = [f"pm{tag}{chr(65 + i)}{pid}" for i in range(count)]
    subnet = f"10.{251 if tag == 'bench' else 252}.{pid % 250 + 1}"
    if count == 2:
        setup_netns(names[0], names[1], subnet, rate)
        made = names
    else:
        bridge = f"pm{tag}Br{pid}"
        made = names + [bridge]
        try:
            setup_bridge(names, bridge, subnet, rate)
        except BaseException:
            teardown_netns(*made)
            raise
    return names, [f"{subnet}.{i + 1}" for i in range(count)], made


def teardown_netns(*names):
    for ns in names:
        sh("ip", "netns", "del", ns, check=False)


def driver(args):
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        sys.exit("overlap_netns.py needs root with the ip and tc tools (network namespaces)")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or sys.exit("mpiexec not found (pip install mpich)")
    env = dict(os.environ, MPIR_CVAR_CH4_NETMOD="ucx", UCX_TLS="tcp,self",
               UCX_NET_DEVICES="pmveth", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    names, addresses, made = make_hosts(args.hosts, "bench", args.rate)
    cmd = ["ip", "netns", "exec", names[0], mpiexec, "-launcher", "ssh", "-launcher-exec",
           os.path.join(HERE, "nsexec.sh"), "-hosts", ",".join(addresses), "-n",
           str(args.hosts), sys.executable, os.path.abspath(__file__), "--worker"] + args.forward
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        sys.exit(f"the benchmark did not finish in {args.timeout} s:\n{e.stdout}\n{e.stderr}")
    finally:
        teardown_netns(*made)
    if proc.returncode != 0:
        sys.exit(f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["rate"] = args.rate or "unlimited"
    print(json.dumps(result))


# ------------------------------------------------------------------ ranks
def timed(world, dispatcher, iters, warmup, profile_from=None):
    """(wall seconds, this process's CPU seconds of all threads) per timed
    iteration, each from the end of the one before (a barrier before the
    first): with a deferred tail an iteration's allreduce and update overlap
    the next one, and the last iteration waits for its own (as ``bench``
    times them)."""
    from purine_mpi.runtime.trace import Profiler
    times, cpu = [], []
    ws = dispatcher.workspace
    for it in range(warmup + iters):
        if it == warmup:
            dispatcher.drain()
            if profile_from is not None:
                dispatcher.profiler = Profiler(world.rank)
            world.barrier()
            t_prev, c_prev = time.perf_counter(), time.process_time()
        if "iter" in ws.arrays:
            ws["iter"][...] = it
        dispatcher.run(it)
        if it >= warmup:
            if it == warmup + iters - 1:
                dispatcher.drain()
            now, c_now = time.perf_counter(), time.process_time()
            times.append(now - t_prev)
            cpu.append(c_now - c_prev)
            t_prev, c_prev = now, c_now
    return times, cpu


def worker(opts):
    import numpy as np
    import yaml

    from purine_mpi.tools.bench import comm_overlap
    from purine_mpi.comm.world import get_world, install_abort_handler
    from purine_mpi.graph import Graph
    from purine_mpi.job.config import resolve_job
    from purine_mpi.layers.fillers import fill
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.parallel.data_parallel import compose_data_parallel
    from purine_mpi.runtime.factory import make_dispatcher

    world = get_world()
    install_abort_handler(world)
    if opts.config:
        with open(opts.config) as f:
            raw = yaml.safe_load(f)
        raw.setdefault("data", {}).pop("test", None)
    else:
        raw = DEFAULT_NET
    if opts.batch:
        raw = dict(raw, data={"train": dict(raw["data"]["train"], batch_size=opts.batch,
                                            num_samples=4 * opts.batch)})
    job = resolve_job(raw, opts.config or "<overlap_netns>", check_files=False)
    if job.data.train.source != "synthetic":
        from purine_mpi.tools.bench import synthetic_config
        job = synthetic_config(job)

    def make(graph, defer=False):
        extra = {} if opts.busy_poll_ms is None else {"busy_poll": opts.busy_poll_ms / 1000}
        d = make_dispatcher(graph, "event", rank=world.rank, stall_timeout=600,
                            defer_tail=defer, **extra)
        for blob in graph.params():
            d.workspace.set(blob.name, fill(blob, 0))
        return d

    def median_ms(times):
        return 1000 * world.comm.allreduce(statistics.median(times)) / world.size

    def write_trace(d, kind):
        if opts.trace:
            with open(os.path.join(opts.trace, f"{kind}_trace.rank{world.rank}.json"), "w") as f:
                json.dump({"traceEvents": d.profiler.events}, f)

    graph, grads = build_train_graph(job, world.rank, world.size)
    d = make(graph)
    compute, compute_cpu = map(median_ms, timed(world, d, opts.iters, opts.warmup,
                                               opts.warmup if opts.trace else None))
    write_trace(d, "compute")
    d.close()

    graph, grads = build_train_graph(job, world.rank, world.size)
    plan = compose_data_parallel(graph, grads, world.size, world.rank,
                                 bucket_mb=opts.bucket_mb, first_bucket_mb=opts.first_bucket_mb,
                                 grad_first=not opts.no_grad_first,
                                 split_params=not opts.no_split)
    graph.infer_shapes().validate()
    comm_graph = Graph("allreduce_only")
    for b in plan:
        n = graph.blobs[b["name"]].shape[0]
        comm_graph.add_blob(b["name"], (n,), kind="bucket")
        comm_graph.add_blob(b["name"] + ".sum", (n,), kind="grad", alias_of=b["name"])
        comm_graph.add_op(b["op"], "Allreduce", [b["name"]], [b["name"] + ".sum"],
                          {"seq": b["seq"], "bucket": b["name"]}, thread="comm")
    d = make(comm_graph.infer_shapes())
    comm, comm_cpu = map(median_ms, timed(world, d, opts.iters, opts.warmup))
    d.close()

    d = make(graph, defer=not opts.no_defer)
    real, real_cpu = map(median_ms, timed(world, d, opts.iters, opts.warmup, opts.warmup))
    overlap = comm_overlap(d.profiler.events)
    write_trace(d, "overlap")
    overlap = world.comm.allreduce(overlap or 0.0) / world.size
    d.close()
    grad_bytes = sum(b["bytes"] for b in plan)
    if world.rank == 0:
        print(json.dumps({
            "config": job.name, "world_size": world.size, "iters": opts.iters,
            "batch_per_rank": job.data.train.batch_size,
            "grad_mb": round(grad_bytes / 2 ** 20, 2), "buckets": len(plan),
            "compute_ms": round(compute, 1), "comm_ms": round(comm, 1),
            "real_ms": round(real, 1), "sum_ms": round(compute + comm, 1),
            "hidden_ms": round(compute + comm - real, 1),
            "cpu_ms": {"compute": round(compute_cpu, 1), "comm": round(comm_cpu, 1),
                       "real": round(real_cpu, 1)},
            "hidden_share_of_comm": round((compute + comm - real) / comm, 3) if comm else None,
            "comm_overlap": round(float(overlap), 3), "grad_first": not opts.no_grad_first,
            "split_params": not opts.no_split, "defer_update": not opts.no_defer,
            "numpy": np.__version__}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="job YAML (default: a built-in conv + 25 MB fc net)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--first-bucket-mb", type=float, default=1.0)
    p.add_argument("--rate", default="1gbit", help="tbf rate per link end ('' = unlimited)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--hosts", type=int, default=2,
                   help="emulated hosts, one rank each (more than 2: joined by a bridge)")
    p.add_argument("--no-grad-first", action="store_true",
                   help="compose without the gradients_first scheduling hint")
    p.add_argument("--no-split", action="store_true",
                   help="keep large weights whole (parallel.split_params: false)")
    p.add_argument("--no-defer", action="store_true",
                   help="end every iteration with its allreduces and updates done "
                        "(parallel.defer_update: false)")
    p.add_argument("--trace", metavar="DIR", help="write the Chrome traces of the compute-only "
                   "and the real run there")
    p.add_argument("--batch", type=int, default=0,
                   help="per-rank batch size (default: the config's; the built-in net has 32, "
                        "where communication dominates; 96 makes compute dominate)")
    p.add_argument("--busy-poll-ms", type=float, default=None,
                   help="the dispatcher's busy_poll: while a worker runs a long op, the "
                        "progress thread tests the transfers in flight every so often "
                        "(default: the dispatcher's, 1 ms; 0: only between ops)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    args.forward = [f"--iters={args.iters}", f"--warmup={args.warmup}",
                    f"--bucket-mb={args.bucket_mb}", f"--first-bucket-mb={args.first_bucket_mb}",
                    f"--batch={args.batch}"]
    if args.config:
        args.forward.append(f"--config={os.path.abspath(args.config)}")
    if args.no_grad_first:
        args.forward.append("--no-grad-first")
    if args.no_split:
        args.forward.append("--no-split")
    if args.no_defer:
        args.forward.append("--no-defer")
    if args.busy_poll_ms is not None:
        args.forward.append(f"--busy-poll-ms={args.busy_poll_ms}")
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        args.forward.append(f"--trace={os.path.abspath(args.trace)}")
    return driver(args)


if __name__ == "__main__":
    main()
