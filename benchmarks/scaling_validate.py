"""Validate the scaling predictor on emulated links: predicted against
measured iteration time of 2 ranks on two network namespaces joined by a
veth pair shaped with tbf (benchmarks/overlap_netns.py).

    sudo .venv/bin/python benchmarks/scaling_validate.py [--nets wide,default]
        [--rates 1gbit,250mbit] [--rounds 3] [--iters 5] [--warmup 2] [--out DIR]
        [--hosts 2]

For each net -- ``wide`` (benchmarks/cifar10_quick_wide.yaml: cifar10_quick
with a 1,024-wide ip1, batch 64) and ``default`` (overlap_netns.py's
built-in net) -- and each round, in turn (interleaved, so that the load of
the machine falls on both sides alike):

1. a 2-rank shared-memory run traces iterations W..W+I-1
   (``mpiexec -n 2 python -m purine_mpi train NET --profile-iters W:W+I``);
2. for each rate: ``predict --calibrate`` measures the link in the two
   namespaces at that rate (α, β, and what a transfer takes from the compute
   on this host), overlap_netns.py measures ``real_ms`` on it, and
   ``predict TRACE --np 2`` predicts it twice: from the calibrated link
   (``--link``) and from the rate alone (``--bandwidth RATE --latency
   50us``: no CPU cost of the transfer, as on a host with a free core).

``--hosts 3`` runs 3 ranks on 3 emulated hosts joined by a bridge (and
traces 3 shared-memory ranks, predicts ``--np 3``). Prints one JSON object: per net and rate, the medians over the rounds of
measured and predicted milliseconds and the relative errors, and every
round's figures. Needs root, ip and tc, MPICH (as overlap_netns.py).

``--rescore RESULT.json --out DIR`` measures nothing: it predicts again,
with the code as it is now, from the traces and link files a run left in
DIR, against the measured figures in RESULT.json (that run's output).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import overlap_netns  # noqa: E402

PY = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PY), "mpiexec")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
LATENCY = "50us"


def net_config(name, folder):
    if name == "wide":
        return os.path.join(HERE, "cifar10_quick_wide.yaml")
    import yaml
    path = os.path.join(folder, "overlap_net.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(overlap_netns.DEFAULT_NET, f, sort_keys=False)
    return path


def run(cmd, timeout=900, env=ENV):
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n"
                 f"{proc.stderr}")
    return proc.stdout


def trace(config, out, warmup, iters, hosts=2):
    run([MPIEXEC, "-n", str(hosts), PY, "-m", "purine_mpi", "train", config, "--out", out, "--force",
         "--iters", str(warmup + iters), "--profile-iters", f"{warmup}:{warmup + iters}",
         "--set", "solver.display=0", "--set", "solver.test_interval=0"])
    return out


def measure(config, rate, warmup, iters, hosts=2):
    out = run([PY, os.path.join(HERE, "overlap_netns.py"), "--config", config, "--rate", rate,
               "--iters", str(iters), "--warmup", str(warmup), "--hosts", str(hosts)])
    return json.loads(out.strip().splitlines()[-1])


def predict(folder, *link_args, hosts=2):
    out = run([PY, "-m", "purine_mpi", "predict", folder, "--np", str(hosts), "--json",
               *link_args])
    row = json.loads(out)["rows"][0]
    return row


def calibrate(rate, path, hosts=2):
    """``predict --calibrate`` between the emulated hosts of overlap_netns.py
    at ``rate``."""
    env = dict(ENV, MPIR_CVAR_CH4_NETMOD="ucx", UCX_TLS="tcp,self", UCX_NET_DEVICES="pmveth")
    names, addresses, made = overlap_netns.make_hosts(hosts, "cal", rate)
    cmd = ["ip", "netns", "exec", names[0], MPIEXEC, "-launcher", "ssh", "-launcher-exec",
           os.path.join(HERE, "nsexec.sh"), "-hosts", ",".join(addresses), "-n", str(hosts),
           PY, "-m", "purine_mpi", "predict", "--calibrate", path]
    try:
        run(cmd, env=env)
    finally:
        overlap_netns.teardown_netns(*made)
    with open(path) as f:
        return json.load(f)


def err(pred, real):
    return round((pred - real) / real, 4)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default="wide,default")
    p.add_argument("--rates", default="1gbit,250mbit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", help="folder for the traces and link files (default: a temporary one)")
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts and ranks (default 2)")
    p.add_argument("--rescore", metavar="RESULT.json",
                   help="predict again from the traces and links in --out (no measuring)")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("scaling_validate.py needs root (network namespaces, tc)")
    folder = args.out or tempfile.mkdtemp(prefix="scaling_validate")
    os.makedirs(folder, exist_ok=True)
    nets, rates = args.nets.split(","), args.rates.split(",")
    if args.rescore:
        return rescore(args, folder)
    rounds, links = [], {}
    for r in range(args.rounds):
        for rate in rates:
            path = os.path.join(folder, f"link_{rate}_r{r}.json")
            cal = calibrate(rate, path, args.hosts)
            links[f"{rate}_r{r}"] = cal
            print(json.dumps({"round": r, "calibrated": rate,
                              "alpha_us": round(cal["alpha_s"] * 1e6, 1),
                              "beta_mbit_s": round(cal["beta_bytes_per_s"] * 8e-6, 1),
                              "cpu_ns_per_byte": round(cal["cpu_s_per_byte"] * 1e9, 2),
                              "beta_busy_mbit_s": round(cal["beta_busy_bytes_per_s"] * 8e-6, 1)}),
                  file=sys.stderr, flush=True)
        for net in nets:
            config = net_config(net, folder)
            tdir = trace(config, os.path.join(folder, f"{net}_r{r}"), args.warmup, args.iters,
                         args.hosts)
            for rate in rates:
                real = measure(config, rate, args.warmup, args.iters, args.hosts)
                cal = predict(tdir, "--link", os.path.join(folder, f"link_{rate}_r{r}.json"),
                              hosts=args.hosts)
                plain = predict(tdir, "--bandwidth", rate, "--latency", LATENCY,
                                hosts=args.hosts)
                row = {"round": r, "net": net, "rate": rate, "real_ms": real["real_ms"],
                       "measured_compute_ms": real["compute_ms"],
                       "measured_comm_ms": real["comm_ms"],
                       "predicted_ms": cal["iter_ms"], "predicted_compute_ms":
                       cal["compute_ms"], "predicted_comm_ms": cal["comm_ms"],
                       "predicted_rate_only_ms": plain["iter_ms"]}
                rounds.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    report(rounds, nets, rates, links, args)


def rescore(args, folder):
    with open(args.rescore) as f:
        old = json.load(f)
    hosts = old.get("hosts", 2)
    rounds = []
    for row in old["rounds"]:
        tdir = os.path.join(folder, f"{row['net']}_r{row['round']}")
        link = os.path.join(folder, f"link_{row['rate']}_r{row['round']}.json")
        cal = predict(tdir, "--link", link, hosts=hosts)
        plain = predict(tdir, "--bandwidth", row["rate"], "--latency", LATENCY, hosts=hosts)
        rounds.append(dict(row, predicted_ms=cal["iter_ms"], predicted_compute_ms=cal["compute_ms"],
                           predicted_comm_ms=cal["comm_ms"],
                           predicted_rate_only_ms=plain["iter_ms"]))
    nets = list(dict.fromkeys(r["net"] for r in rounds))
    rates = list(dict.fromkeys(r["rate"] for r in rounds))
    args.hosts, args.iters, args.warmup = hosts, old["iters"], old["warmup"]
    report(rounds, nets, rates, old["links"], args)


def report(rounds, nets, rates, links, args):
    summary = []
    for net in nets:
        for rate in rates:
            rows = [x for x in rounds if x["net"] == net and x["rate"] == rate]
            med = {k: statistics.median(x[k] for x in rows) for k in
                   ("real_ms", "predicted_ms", "predicted_rate_only_ms",
                    "measured_compute_ms", "predicted_compute_ms")}
            summary.append(dict(net=net, rate=rate, **{k: round(v, 1) for k, v in med.items()},
                                error=err(med["predicted_ms"], med["real_ms"]),
                                error_rate_only=err(med["predicted_rate_only_ms"],
                                                    med["real_ms"]),
                                round_errors=[err(x["predicted_ms"], x["real_ms"])
                                              for x in rows],
                                round_errors_rate_only=[err(x["predicted_rate_only_ms"],
                                                            x["real_ms"]) for x in rows]))
    print(json.dumps({"summary": summary, "rounds": rounds, "latency": LATENCY,
                      "hosts": args.hosts, "rescored": bool(getattr(args, "rescore", None)),
                      "links": links,
                      "iters": args.iters, "warmup": args.warmup}))


if __name__ == "__main__":
    main()
