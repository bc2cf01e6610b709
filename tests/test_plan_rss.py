"""``plan``'s host figures against what the run holds: the data pool row is
the readers' own bytes, and train's OUT/memory.json (the measured resident
bytes above the baseline) is at least the predicted host total on every
rank and within 10% of it, NIN's within 5% (docs/running.md, "Will it fit?", has the table
and the gap); the host scratch and kernel temporaries rows are what the
kernels hold after an iteration."""
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from purine_mpi.data.sources import make_source, resident_bytes
from purine_mpi.data.text import TextSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import rss_vs_plan  # noqa: E402

from tests.conftest import run_cli_here  # noqa: E402

#: run in a fresh process: one training iteration and, where the job has a
#: test split, one test batch; then what the kernels hold
#: (ops/im2col.held_bytes) and the largest new arrays any host kernel took
#: from ``OpKernel.temporaries`` at once per worker thread, against the
#: footprint's rows for the same graphs
_PROBE = """
import json, sys, threading
from purine_mpi.job.config import load_job
from purine_mpi.ops import im2col
from purine_mpi.ops.registry import OpKernel
from purine_mpi.runtime.factory import dispatcher_kind
from purine_mpi.runtime.footprint import host_kernel_bytes
from purine_mpi.train.trainer import Trainer
biggest, lock, orig = {}, threading.Lock(), OpKernel.temporaries
def temporaries(self, like, *specs):
    out = orig(self, like, *specs)
    with lock:
        lane = threading.current_thread().name
        biggest[lane] = max(biggest.get(lane, 0), sum(a.nbytes for a in out))
    return out
OpKernel.temporaries = temporaries
t = Trainer(load_job(sys.argv[1], sys.argv[3:], None, check_files=False), sys.argv[2],
            log=lambda m: None)
try:
    t.step(0)
    t.train.drain()
    tg = t.graphs.test_graph
    if tg is not None:
        t.evaluate(1)
    print(json.dumps({"held": im2col.held_bytes(), "temporaries": sum(biggest.values()),
                      "planned": host_kernel_bytes(t.graphs.graph, tg, dispatcher_kind() == "serial"),
                      "test": tg is not None}))
finally:
    t.close()
"""


def _text_data(tmp_path, email_h5):
    """rss_vs_plan.text_data's token file in ``tmp_path``: the session's
    (conftest.email_h5 runs the same ``data text`` command on the email
    package), copied there so that it is not made again (0.8 s a test)."""
    shutil.copyfile(email_h5, tmp_path / "email.h5")
    return rss_vs_plan.text_data(str(tmp_path))


def test_resident_bytes_are_what_the_sources_hold(tmp_path, email_h5):
    spec = {"source": "synthetic", "shape": [3, 32, 32], "classes": 10, "num_samples": 700}
    src = make_source(spec, 0)
    assert resident_bytes(spec) == (None, src.pool.nbytes + src.labels.nbytes)
    path = _text_data(tmp_path, email_h5)
    text = {"source": "text", "path": path, "split": "train", "sequence_length": 64}
    t = TextSource(text)
    assert resident_bytes(text) == (None, t.tokens.nbytes + t._offsets.nbytes)


def test_data_pool_counts_the_epoch_order(tmp_path, email_h5):
    """A shuffled source's reader holds its epoch's permutation of the
    samples (data/sources.EpochOrder): plan's data pool row counts it, from
    the job (the text split's windows), and the array is that size."""
    from purine_mpi.data.sources import EpochOrder, order_bytes
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.plan import offline_footprint
    path = _text_data(tmp_path, email_h5)
    spec = {"source": "text", "path": path, "split": "train", "sequence_length": 128,
            "shuffle": True}
    held = EpochOrder(TextSource(spec).n_samples, True)(0).nbytes
    assert order_bytes(spec) == held > 0
    assert order_bytes(dict(spec, shuffle=False)) == 0

    def pool(shuffle):
        job = load_job(os.path.join(ROOT, "jobs", "gpt_tiny.yaml"),
                       [f"data.train.path={path}", f"data.test.path={path}",
                        f"data.train.shuffle={shuffle}"], None, check_files=False)
        return offline_footprint(job, 1, 0).host["data_pool"]
    assert pool("true") - pool("false") == held


#: run in a fresh process: ``train`` for one iteration on one rank, the
#: extension modules first imported after memory.json's baseline was read,
#: and the resident bytes of executable file mappings (the libraries' code:
#: benchmarks/smaps_by_mapping.py's ``code`` class) then and at the end
_AFTER_BASELINE = """
import json, sys
import purine_mpi.train.trainer as T
from purine_mpi.cli import main
sys.path.insert(0, "benchmarks")
from smaps_by_mapping import smaps_by_class
seen, code, real = [], [], T.rss_bytes
def rss_bytes():
    seen.append(set(sys.modules))
    code.append(smaps_by_class()["code"])
    return real()
T.rss_bytes = rss_bytes
status = main(sys.argv[1:])
new = [m for m in set(sys.modules) - seen[0]
       if str(getattr(sys.modules[m], "__file__", "") or "").endswith((".so", ".pyd"))]
print("after:", sorted(new))
print("code:", json.dumps(smaps_by_class()["code"] - code[0]))
sys.exit(status)
"""


def test_no_library_is_loaded_after_the_baseline(tmp_path, email_h5):
    """memory.json's baseline is read after the imports the run defers
    (base/rss.DEFERRED_IMPORTS: numpy.random's extension modules, ...): no
    extension module's code joins the resident bytes above it; and after
    base/rss.warm_up_libraries ran the libraries' code once, so that the
    library code the whole run first executes after the baseline is under
    1 MiB (gpt_tiny here: 0.43-0.46 MiB; 2.27 before the warm-up, NumPy's loops,
    HDF5's, libyaml's emitter, OpenBLAS's and numpy.random's). The test
    passes (before training and at the end) read one batch each
    (``solver.test_iter``: the same graph and code as the whole split's 10,
    7 s less)."""
    data = _text_data(tmp_path, email_h5)
    p = subprocess.run([sys.executable, "-c", _AFTER_BASELINE, "train",
                        os.path.join(ROOT, "jobs", "gpt_tiny.yaml"), "--out", str(tmp_path / "o"),
                        "--iters", "1", "--set", "data.train.batch_size=2",
                        "--set", f"data.train.path={data}", "--set", f"data.test.path={data}",
                        "--set", "solver.test_interval=0", "--set", "solver.test_iter=1",
                        "--set", "checkpoint.interval=0"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "after: []" in p.stdout, p.stdout[-2000:]
    code = json.loads(p.stdout.split("code:")[1].split()[0])
    assert 0 <= code < 1 << 20, code / 2**20


#: a test split for the CNN jobs (they have none): its graph's kernels run on
#: the test dispatcher's own worker threads, whose buffers are held beside
#: the training graph's
_CNN_TEST = ["data.test={source: synthetic, shape: [3, 32, 32], classes: 10, num_samples: 100, "
             "batch_size: 50}", "solver.test_interval=1"]


#: (cifar10_quick without a test split is not a case of its own: nin_cifar10
#: is the CNN without one, on the same event dispatcher and conv/pool kernels)
@pytest.mark.parametrize("job,sets", [
    ("cifar10_quick", ["data.train.batch_size=20"] + _CNN_TEST),
    ("cifar10_quick serial", ["data.train.batch_size=20"] + _CNN_TEST),
    ("nin_cifar10", ["data.train.batch_size=4"]),
    ("gpt_tiny", ["data.train.batch_size=8"]),
])
def test_host_rows_are_what_the_kernels_hold(job, sets, tmp_path, email_h5):
    """plan's host scratch row is the bytes the conv/pool kernels' buffers
    hold after an iteration and a test batch (im2col.held_bytes), to the
    byte (the test graph's kernels' too, on its dispatcher's threads: 9.4 of
    cifar10_quick's 20.2 MB with the test split here), and its kernel
    temporaries row at least the largest temporaries a host kernel took
    (``host_temporaries`` also counts a run's NumPy temporaries:
    tests/test_host_temporaries.py)."""
    if job.startswith("gpt"):
        path = _text_data(tmp_path, email_h5)
        sets = sets + [f"data.train.path={path}", f"data.test.path={path}"]
    job, _, serial = job.partition(" ")  # "serial": the serial dispatcher, one thread
    env = dict(os.environ, PURINE_DISPATCHER=serial or "event")
    p = subprocess.run([sys.executable, "-c", _PROBE, os.path.join(ROOT, "jobs", f"{job}.yaml"),
                        str(tmp_path / "out")] + sets, capture_output=True, text=True,
                       cwd=ROOT, timeout=600, env=env)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["planned"]["host_scratch"] == got["held"], got
    assert got["planned"]["kernel_temporaries"] >= got["temporaries"], got
    assert got["held"] > 0 or got["temporaries"] > 0
    assert got["test"] == any(s.startswith("data.test") for s in sets)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
@pytest.mark.parametrize("job,within,iters", [("cifar10_quick", 0.10, 3), ("gpt_tiny", 0.10, 3),
                                              ("nin_cifar10", 0.05, 2)])
def test_predicted_host_total_is_held(job, within, iters, tmp_path, email_h5):
    """Under mpiexec -n 2 (scheme data) every counted byte is resident: the
    measured peak above the baseline is at least plan's host total less 3%
    (its kernel temporaries row adds each lane's largest op, which need not
    all be live at one moment: with one malloc arena gpt_tiny's plan was
    1.2% above the measured peak in 1 run of 13), and the total is within
    10% of it (15% before the baseline followed base/rss.warm_up_libraries:
    2026-11-30, interleaved A/B of benchmarks/rss_vs_plan.py's cases, 2
    runs each, the plan 4.3-6.6% (cifar10_quick) and 5.2-7.4% (gpt_tiny)
    below the measured peak with the warm-up, 6.8-9.2% and 8.4-11.0%
    without it: gpt_tiny failed this bound in 2 of those 4 rank figures
    and in both of docs/running.md's "before" run;
    earlier, with one malloc arena, the default: 4.9-7.3% below, 5.5-8.3%
    on 2026-11-29, docs/running.md, 9.6-11.6% with glibc's arena per
    thread; within 20% before the baseline followed the deferred imports
    and the data pool counted the epoch order). NIN (472.3 MiB planned),
    where the unplanned megabytes are a small part, is held to issue 44's
    5%: 2.1-3.3% below in docs/running.md's before and after runs. NIN
    runs 2 iterations: its peak is reached by then (2026-11-30 under load,
    mpiexec -n 2, one run each: the measured peak 2.36-2.40% above plan at 2
    iterations, 2.37-2.42% at 3, 1.54-1.60% at 1), and each NIN iteration
    costs seconds of CI; the other jobs 3."""
    if job.startswith("gpt"):
        _text_data(tmp_path, email_h5)
    res = rss_vs_plan.measure(job, "data", str(tmp_path), iters=iters, plan_with=run_cli_here)
    assert "error" not in res, res
    assert len(res["measured"]) == 2
    for p, m, b in zip(res["predicted"], res["measured"], res["baseline"]):
        assert b > 0 and p > 0
        assert m >= 0.97 * p, (job, p, m)
        assert p >= (1 - within) * m, (job, p, m)
    assert json.loads(json.dumps(res["plan"]))["ranks"][0]["host"]["data_pool"] > 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
def test_sharded3_test_pass_holds_what_plan_says(tmp_path, email_h5):
    """mpiexec -n 2, gpt_small at ZeRO stage 3 with a test split (batch 4,
    2 iterations, one test batch before the first and at the end): plan's
    host total is within issue 44's 5% of the measured peak above the
    baseline on every rank, and the peak at least the total less 3%. The
    test graph's whole weights are in the weights row; a pass fills them
    from the shards in place (Sharded.give_test_weights). Measured
    2026-11-30: 329.2 MB planned, 340.1-340.5 MB held (-3.2%, -3.3%); before, the
    pickled allgather of the shards and their join held 2W + 2W/N more for
    a moment: 441.6-442.3 MB (-25.4% to -25.6%), 'assert 329219349 >= (0.95 *
    442089472)'."""
    _text_data(tmp_path, email_h5)
    sets = ["solver.test_iter=1", "data.train.batch_size=4", "data.test.batch_size=4"]
    res = rss_vs_plan.measure("gpt_small", "sharded3", str(tmp_path), iters=2, sets=sets,
                              plan_with=run_cli_here)
    assert "error" not in res, res
    assert len(res["measured"]) == 2
    for p, m in zip(res["predicted_resident"], res["measured"]):
        assert m >= 0.97 * p, (p, m)
        assert p >= 0.95 * m, (p, m)


def _wide_cifar(tmp_path):
    """cifar10_quick with two wide fc layers (ip1 1024 -> 4096, ip1b 4096 ->
    1024: 16 MiB of weights each) and 200 samples a batch: a parameter
    server holds several copies of its share of the weights (tens of MiB
    beside the ~7 MiB a process adds above the baseline unplanned), a
    worker the activations of cifar10_quick, two servers one wide layer
    each."""
    import yaml
    cfg = yaml.safe_load(open(os.path.join(ROOT, "jobs", "cifar10_quick.yaml")))
    net = []
    for layer in cfg["net"]:
        if layer["name"] == "ip1":
            net += [dict(layer, num_output=4096),
                    {"type": "relu", "name": "relu_ip1", "bottom": "ip1", "top": "ip1"},
                    {"type": "fc", "name": "ip1b", "bottom": "ip1", "top": "ip1b",
                     "num_output": 1024}]
        else:
            net.append(dict(layer, bottom="ip1b") if layer["name"] == "ip2" else layer)
    cfg["net"] = net
    cfg["data"]["train"]["batch_size"] = 200
    path = tmp_path / "cifar10_wide.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
@pytest.mark.parametrize("mode,ranks,servers,interval", [("sync_ps", 4, 2, 2), ("async", 4, 2, 0)])
def test_parameter_server_ranks_hold_what_plan_says(mode, ranks, servers, interval, tmp_path):
    """Every rank of a parameter-server run, workers and servers (their
    figures in memory.json since issue 44), holds at least plan's host total
    less 1% and is within 6.5% below it. Issue 44's target is 5%, and with
    the baseline after base/rss.warm_up_libraries this machine meets it:
    2026-11-30 on a quiet machine, three runs of each case, every rank
    1.3-4.4% above plan (sync_ps workers 4.1-4.4%); under load four runs,
    1.2-3.7%. The bound stays 6.5% (15% before 2026-11-29) because quiet
    runs read higher than loaded ones and the margin at 5% is 0.6%: a
    machine with other core and thread counts must not fail the suite on
    it. Earlier figures: at
    30f4801, without it, one run: sync_ps 4.7-5.0%, async 1.7-3.8%. The MPI
    shared-memory cells are planned now (comm/mpi_transport.py: 1.5 MiB a
    rank here), but before the warm-up the sync_ps workers measured 5.4-5.6% above plan
    on a quiet machine (5 runs, 2026-11-29 after the merges: rank 0 232.2
    MiB planned, 245.1 measured; rank 1 185.2 and 195.5): the 10-13 MiB
    every process holds unplanned (docs/running.md, "The sync_ps workers'
    gap, attributed": the arrays are the rows to within 0.7 MiB; MPICH's
    request and communicator pools, 3.8 MiB, code pages, OpenBLAS's buffer
    and glibc's heap are the rest, none of them the job's), which a 5% bound at
    these sizes does not leave room for (a helper's two runs under load
    read 4.7-4.8% and set 5%: it failed every quiet run; the warm-up took
    2.1-3.5 MiB off each worker's figure under the same load, so a quiet
    run should read about 4.0-4.4% -- not measured: no quiet machine here); sync_ps with a
    save at iteration 2 of 3 (rank 0 takes the servers' momenta), async
    with the end's only (its servers send their state once their loops
    freed their receive and reply buffers: 129.0 MiB planned, 116.9
    measured, 'assert 122593280 >= (0.99 * 135241728)', before the plan
    left them out there and at the first fill; a state asked for between
    two pushes, with them: tests/test_plan.py), and glibc's mmap threshold fixed (PURINE_MMAP_THRESHOLD: the arrays a
    save frees leave the resident bytes; with the dynamic threshold rank 0
    kept 28 MiB of the first save's arrays and measured 13-14% above the
    figure). Measured 2026-11-29, two runs under load: sync_ps 2.8-4.8% above plan,
    async 1.8-3.7% (before the transport row: 4.0-5.9% and 1.9-5.1%);
    earlier, three runs of each case from a shell: 2.2-5.7% above
    plan, the 4.4-13.3 MiB every process holds unplanned (docs/running.md);
    the sync_ps workers 5.1-5.6% (6.1-6.6% before the finiteness check
    after the last iteration stopped holding a byte an element of the
    largest weight: 4 MiB, test_trust5_agree.py); 2.3-8.6% before HDF5's
    buffers at rank 0's save were bounded. Before, plan refused these modes
    (exit 2), and memory.json had no server. Two servers only (the cases of
    one server on 3 ranks were dropped for CI time, 2 x ~10 s): each server
    runs the one server's code on its share, and one server's rows are
    checked to the byte offline, both modes
    (test_plan.py::test_parameter_server_ranks_are_what_they_allocate)."""
    res = rss_vs_plan.measure("cifar10_quick", mode, str(tmp_path), np_=ranks, iters=3,
                              env={"PURINE_MMAP_THRESHOLD": "131072"},
                              sets=[f"parallel.ps_ranks={servers}",
                                    f"checkpoint.interval={interval}"],
                              path=_wide_cifar(tmp_path), plan_with=run_cli_here)
    assert "error" not in res, res
    assert len(res["measured"]) == ranks
    for r, (p, m) in enumerate(zip(res["predicted"], res["measured"])):
        assert m >= 0.99 * p, (mode, r, p, m)
        assert p >= m / 1.065, (mode, r, p, m)
    kinds = {r: k for k in res["plan"]["ranks"] for r in k["ranks"]}
    server = kinds[ranks - 1]["host"]
    assert server["optimizer_state"] > 0 and server["checkpoint_save"] > 0
    assert kinds[0]["host"]["checkpoint_save"] > 0  # the servers' momenta (async: weights)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_parameter_servers_loading_init_hold_what_plan_init_says(mode, tmp_path):
    """``plan --init`` of a parameter-server run (3 ranks, one server; 8 fc
    layers of 768 x 768, 18.1 MiB of weights) whose --init file holds 128
    MiB more (an array the net does not read, read whole on every rank:
    the load is each rank's peak): every rank holds at least the plan's
    host total less 2% and the total is within 12% of it (glibc's mmap
    threshold fixed; measured 2026-11-29: workers 9.7-9.8% above plan, the
    ~16 MiB a process holds unplanned; async rank 0 1.1% below, its
    start-up rows holding 18 MiB it has not written yet; the servers 9.7%
    and 10.5% above. 2026-11-30, with base/rss.warm_up_libraries before the
    baseline, async rank 0 measured 2.6-2.8% below, 'assert 185815040 >=
    (0.98 * 191253768)': its `kept` row, the servers' momenta it keeps from
    the first sync on (Scheme.held_bytes), was in its start-up figure; now
    not (Footprint.held): every rank 7.9-8.8% above plan, sync_ps and
    async). A server reads the file before it allocates its
    arrays, its windows alone (tools/plan.set_load): before, plan counted
    the file on every start-up row, the async server's receive and reply
    buffers too: 236.3 MiB planned, 160.1 measured."""
    from purine_mpi.job.checkpoint_file import save_checkpoint
    from purine_mpi.job.config import load_job
    from purine_mpi.parallel.rank_graphs import build_rank_graphs
    from purine_mpi.tools.graph import _OfflineWorld
    from tests.conftest import write_config_file
    from tests.test_sharded_rss import _deep_mlp
    cfg = _deep_mlp()
    cfg["solver"] = {"type": "sgd", "base_lr": 0.01, "momentum": 0.9, "max_iter": 3,
                     "display": 0, "test_interval": 0}
    cfg["parallel"] = {"scheme": "data", "mode": mode, "ps_ranks": 1,
                       "transport": "two_sided", "max_staleness": int(mode == "async")}
    path = write_config_file(tmp_path, cfg, "deep_mlp.yaml")
    job = load_job(path, ["parallel.mode=sync"], None, check_files=False)
    g = build_rank_graphs(job, _OfflineWorld(0, 1), check_memory=False)
    rng = np.random.default_rng(0)
    values = {p: (rng.standard_normal(g.graph.blobs[p].shape) * 0.01).astype(np.float32)
              for p in g.params}
    values["extra/weight"] = np.ones(128 << 18, np.float32)
    init = str(tmp_path / "w.h5")
    save_checkpoint(init, values)
    del values
    env = {**os.environ, "PURINE_MMAP_THRESHOLD": "131072"}
    args = ["--set", "checkpoint.interval=0", "--init", init]
    p = run_cli_here("plan", path, "--np", "3", "--json", *args)  # offline: in this process
    assert p.returncode == 0, p.stderr
    planned = {r: k["host"] for k in json.loads(p.stdout)["ranks"] for r in k["ranks"]}
    measured = rss_vs_plan.train_memory(path, args, str(tmp_path / "run"), 3, 3, env)
    assert not isinstance(measured, str), measured
    for r, got in enumerate(measured):
        plan, m = planned[r], got["above_baseline_bytes"]
        assert plan["startup_load"] >= 128 << 20 and plan["total"] == plan["load_total"], (r, plan)
        assert m >= 0.98 * plan["total"], (mode, r, plan["total"], m)
        assert plan["total"] >= 0.88 * m, (mode, r, plan["total"], m)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
def test_a_resumed_run_holds_what_plan_resume_says(tmp_path):
    """One rank of the wide cifar10_quick (33.9 MB of weights, as many of
    momentum), 1 iteration and its checkpoint, then --resume auto for a
    second: ``plan --resume``'s host total is at least the resumed run's
    peak above the baseline less 8% (measured 230.5 / 240.2 MiB, -4.0%, and
    240.4-240.6 on 2026-11-29: the
    ~5 MiB a process adds unplanned and HDF5's first read) and at most 3%
    above it (the checkpoint, read whole before the graphs, is dropped once
    the weights are set: held to the run's end before, 303.5 MiB measured,
    -24%), and the start-up
    load's checkpoint part is the file's arrays to the byte (glibc's mmap
    threshold fixed, as the parameter-server test). Its resumed train, then
    started from the pytest worker with subprocess (now under mpiexec -n 1
    as the first), said 941,711,360 bytes above the baseline in a
    whole-suite run: the worker's own peak, which getrusage's ru_maxrss
    passes on through vfork and execve (base/rss.peak_rss_bytes reads VmHWM
    since: test_a_large_starter_is_not_the_peak)."""
    from purine_mpi.job.checkpoint_file import load_checkpoint
    from purine_mpi.tools.plan import arrays_nbytes
    path = _wide_cifar(tmp_path)
    env = {**os.environ, "PURINE_MMAP_THRESHOLD": "131072"}
    _, sets = rss_vs_plan.sets_for("cifar10_quick", "data", str(tmp_path))
    args = [a for s in sets for a in ("--set", s)]
    run = str(tmp_path / "run")
    first = rss_vs_plan.train_memory(path, args, run, np_=1, iters=1, env=env)
    assert not isinstance(first, str), first
    t = subprocess.run(["mpiexec", "-n", "1"] + rss_vs_plan.PY +
                       ["train", path, "--out", run, "--iters", "2", "--resume", "auto"] + args,
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert t.returncode == 0, t.stderr
    measured = json.load(open(os.path.join(run, "memory.json")))["ranks"][0]
    plans = {}
    for flag in ((), ("--resume",)):  # in this process: plan's figures are offline
        p = run_cli_here("plan", path, "--json", *flag, *args, cwd=ROOT)
        assert p.returncode == 0, p.stderr
        plans[flag] = json.loads(p.stdout)["ranks"][0]["host"]
    planned, m = plans[("--resume",)], measured["above_baseline_bytes"]
    held = arrays_nbytes(load_checkpoint(os.path.join(run, "latest.h5")))
    # the file's arrays, and the larger of the first fill (a fresh start's
    # load) and the momentum the resume sets
    assert planned["startup_load"] == held + max(plans[()]["startup_load"],
                                                 planned["optimizer_state"])
    assert m >= 0.97 * planned["total"], (planned["total"], m)
    assert planned["total"] >= 0.92 * m, (planned["total"], m)


#: run in a fresh process: touch LARGE bytes and free them (this process's
#: peak, as a pytest worker's late in a whole-suite run, about 1 GB), then
#: start processes with subprocess (vfork where it can: the child executes
#: in this process's memory until its execve): a bare Python's getrusage
#: ``ru_maxrss``, then ``train`` and ``bench --json`` of CONFIG
_LARGE_STARTER = """
import json, os, resource, subprocess, sys
from types import SimpleNamespace

import numpy as np
large, config, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
a = np.ones(large // 8)
del a
def run(*args):
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()[-1]
bare = int(run("-c", "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"))
run("-m", "purine_mpi", "train", config, "--out", out)
bench = json.loads(run("-m", "purine_mpi", "bench", config, "--iters", "1", "--warmup", "0",
                       "--json"))
print(json.dumps({"bare_ru_maxrss": bare * 1024, "bench": bench["max_rss_bytes"],
                  **json.load(open(os.path.join(out, "memory.json")))["ranks"][0]}))
"""


def test_a_large_starter_is_not_the_peak(tmp_path):
    """A process started by one that had 512 MiB resident (a pytest worker
    late in the suite, a notebook) reports its own peak: memory.json's
    ``peak_rss_bytes`` and ``bench --json``'s ``max_rss_bytes`` of a
    one-layer job are tens of MiB (base/rss.peak_rss_bytes reads VmHWM),
    though the kernel's getrusage ``ru_maxrss`` of a bare Python started the
    same way is the starter's 512 MiB (Linux keeps it across execve; before,
    memory.json said 489,820,160 bytes above the baseline here)."""
    from tests.conftest import cli_env, tiny_fc_config, write_config_file
    large = 512 << 20
    config = write_config_file(tmp_path, tiny_fc_config(), "tiny.yaml")
    p = subprocess.run([sys.executable, "-c", _LARGE_STARTER, str(large), config,
                        str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT,
                       env=cli_env(), timeout=600)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    if got["bare_ru_maxrss"] < large:
        pytest.skip("this Python or kernel does not pass the starter's peak on")
    assert got["baseline_rss_bytes"] <= got["peak_rss_bytes"] < large / 2, got
    assert got["above_baseline_bytes"] < 64 << 20, got
    assert got["bench"] < large / 2, got


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux /proc only")
def test_peak_rss_reads_vmhwm_and_falls_back_to_ru_maxrss(monkeypatch):
    """peak_rss_bytes is /proc/self/status's VmHWM: reset to the resident
    bytes (clear_refs), it rises by a 64 MiB array touched (less the kernel
    counters' batching: 0.1 MiB seen) and stays there once the array is
    freed; without /proc it is getrusage's ru_maxrss (KiB on Linux). (The
    reading a process started by a large one does not inherit:
    test_a_large_starter_is_not_the_peak.)"""
    import numpy as np

    from purine_mpi.base import rss
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss.rss_bytes()
    a = np.ones(8 << 20)
    del a
    assert rss.peak_rss_bytes() >= before + (60 << 20) > rss.rss_bytes() + (32 << 20)

    def no_proc(*args, **kwargs):
        raise FileNotFoundError("/proc/self/status")
    monkeypatch.setattr(rss, "open", no_proc, raising=False)
    monkeypatch.setattr(rss.resource, "getrusage",
                        lambda who: __import__("types").SimpleNamespace(ru_maxrss=12345))
    monkeypatch.setattr(rss, "_peak_seen", 0)
    assert rss.peak_rss_bytes() == 12345 * 1024


def test_peak_rss_never_goes_down(monkeypatch):
    """VmHWM read twice can go down by a few pages (the kernel shows the
    larger of its recorded mark and the lagging resident count: memory.json's
    loop peak was 12 KiB above the run's peak on one rank of
    test_sharded3); peak_rss_bytes returns the largest figure it has read."""
    import io

    from purine_mpi.base import rss
    readings = iter([100, 97, 103])
    monkeypatch.setattr(rss, "_peak_seen", 0)
    monkeypatch.setattr(rss, "open", lambda *a, **k: io.StringIO(
        f"Name:\tx\nVmHWM:\t{next(readings)} kB\n"), raising=False)
    assert [rss.peak_rss_bytes() for _ in range(3)] == [102400, 102400, 105472]


#: run in a fresh process: train's load of ``--init``'s weights (argv[1])
#: for the job (argv[2], --set values after): the file's reader, then the
#: finiteness check (train/checkpoints.py), once (the code's first run, its
#: imports) and again with the resident high-water mark reset
#: (/proc/self/clear_refs 5): that load's peak above the resident bytes
#: before it, and plan's figure (tools/plan.init_bytes)
_INIT_LOAD = """
import json, sys
from purine_mpi.base.rss import rss_bytes
from purine_mpi.job.checkpoint_check import check_finite
from purine_mpi.job.config import load_job
from purine_mpi.tools.plan import init_bytes
path, job = sys.argv[1], load_job(sys.argv[2], sys.argv[3:], None, check_files=False)
if path.endswith(".caffemodel"):
    from purine_mpi.interop.caffemodel import caffe_params
    from purine_mpi.parallel.rank_graphs import build_rank_graphs
    from purine_mpi.tools.graph import _OfflineWorld
    g = build_rank_graphs(job, _OfflineWorld(0, 1), check_memory=False)
    shapes = {p: g.graph.blobs[p].shape for p in g.params}
    load = lambda: caffe_params(path, shapes)[0]
elif path.endswith(".safetensors"):
    from purine_mpi.interop.hf_gpt2 import hf_params
    load = lambda: hf_params(path, job)[0]
else:
    from purine_mpi.job.checkpoint_file import load_params
    load = lambda: load_params(path)
def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
check_finite(load(), path)
base = rss_bytes()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
check_finite(load(), path)
print(json.dumps({"measured": peak() - base, "planned": init_bytes(path, job)}))
"""


def _init_file(fmt, tmp_path, email_h5):
    """(an --init file of ``fmt``, the job and its --set values): the wide
    cifar10_quick's weights (33.9 MB, two 16 MiB fc weights) in our HDF5
    layout and as a .caffemodel (written by tests/test_caffemodel.py's
    encoder, protowire's BlobProto), gpt_small's (43.4 MB) as GPT-2's
    safetensors file (Conv1D weights transposed) and in bfloat16."""
    from purine_mpi.job.config import load_job
    from purine_mpi.parallel.rank_graphs import build_rank_graphs
    from purine_mpi.tools.graph import _OfflineWorld
    if fmt in ("h5", "caffemodel"):
        config, sets = _wide_cifar(tmp_path), []
    else:
        config = os.path.join(ROOT, "jobs", "gpt_small.yaml")
        data = _text_data(tmp_path, email_h5)
        sets = [f"data.train.path={data}", f"data.test.path={data}"]
    job = load_job(config, sets, None, check_files=False)
    g = build_rank_graphs(job, _OfflineWorld(0, 1), check_memory=False)
    rng = np.random.default_rng(0)
    values = {p: rng.standard_normal(g.graph.blobs[p].shape).astype(np.float32)
              for p in g.params}
    path = str(tmp_path / f"w.{'h5' if fmt == 'h5' else fmt if fmt == 'caffemodel' else 'safetensors'}")
    if fmt == "h5":
        from purine_mpi.job.checkpoint_file import save_checkpoint
        save_checkpoint(path, values)
    elif fmt == "caffemodel":
        from purine_mpi.data.protowire import write_blob
        from tests.test_caffemodel import length_delimited, string
        layers = {}
        for p, v in values.items():
            layers.setdefault(p.split("/")[0], {})[p.split("/")[1]] = v
        model = string(1, "wide") + b"".join(
            length_delimited(100, string(1, name) + string(2, "InnerProduct") + b"".join(
                length_delimited(7, write_blob(w[k])) for k in ("weight", "bias") if k in w))
            for name, w in layers.items())
        with open(path, "wb") as f:
            f.write(model)
    else:
        st = pytest.importorskip("safetensors.numpy")
        from purine_mpi.interop.hf_gpt2 import gpt2_layout
        tensors = {hf: np.ascontiguousarray(values[ours].T if t else values[ours])
                   for hf, ours, t in gpt2_layout(job).tensors}
        if fmt == "safetensors":
            st.save_file(tensors, path)
        else:  # bfloat16: each float32's top 16 bits (NumPy has no bfloat16 to save)
            header, data = {}, b""
            for name, v in tensors.items():
                b = (v.view(np.uint32) >> 16).astype("<u2").tobytes()
                header[name] = {"dtype": "BF16", "shape": list(v.shape),
                                "data_offsets": [len(data), len(data) + len(b)]}
                data += b
            text = json.dumps(header).encode()
            text += b" " * (-len(text) % 8)
            with open(path, "wb") as f:
                f.write(len(text).to_bytes(8, "little") + text + data)
    return path, config, sets, job


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's clear_refs")
@pytest.mark.parametrize("fmt", ["h5", "caffemodel", "safetensors", "bf16"])
def test_init_load_is_what_plan_counts(fmt, tmp_path, email_h5):
    """``plan --init``'s start-up load of each file train's --init reads
    (tools/plan.init_bytes) is the arrays the reader makes, to the byte, and
    the resident bytes the load holds at its peak within 2% (glibc's mmap
    threshold fixed; measured -0.2..+0.6%): our HDF5 file's /params; a
    .caffemodel read whole and every blob copied out as float32 (33.9 +
    33.9 MB; 101.2 MB measured before protowire read a packed blob
    without two more copies of it, and 0 counted); a float32 safetensors
    file's mapped pages and arrays (43.4 + 43.4 MB; 0 counted before); a
    bfloat16 one's float32 arrays and the transposed copies of GPT-2's
    Conv1D weights (43.4 + 42.5 MB)."""
    from purine_mpi.tools.plan import init_bytes
    path, config, sets, job = _init_file(fmt, tmp_path, email_h5)
    planned = init_bytes(path, job)
    if fmt == "h5":
        from purine_mpi.job.checkpoint_file import load_params
        assert planned == sum(v.nbytes for v in load_params(path).values())
    elif fmt == "caffemodel":
        from purine_mpi.interop.caffemodel import read_layers
        arrays = sum(b.nbytes for *_, blobs in read_layers(path) for b in blobs)
        assert planned == os.path.getsize(path) + arrays
    else:
        import purine_mpi.interop.hf_gpt2 as hf
        tensors = hf.read_tensors(path)
        real, hf.read_tensors = hf.read_tensors, lambda p: tensors
        try:
            values, _ = hf.hf_params(path, job)
        finally:
            hf.read_tensors = real
        kept = sum(v.nbytes for v in tensors.values())
        copies = sum(v.nbytes for v in values.values()
                     if not any(np.shares_memory(v, t) for t in tensors.values()))
        if fmt == "safetensors":  # the file's pages, mapped while its arrays are read
            import safetensors.numpy as st
            read = os.path.getsize(path) + sum(v.nbytes for v in st.load_file(path).values())
            assert planned == max(read, kept + copies) == read
        else:
            assert planned == kept + copies
        assert copies > 0.9 * kept
    env = dict(os.environ, PURINE_MMAP_THRESHOLD="131072")
    p = subprocess.run([sys.executable, "-c", _INIT_LOAD, path, config] + sets,
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["planned"] == planned
    assert abs(got["measured"] - planned) <= 0.02 * planned, (fmt, got)


_FREED = """
from types import SimpleNamespace

import numpy as np
import purine_mpi
from purine_mpi.base.rss import rss_bytes
base = rss_bytes()
for _ in range(5):
    a = np.ones(8 << 20, np.float32)   # 32 MiB: mapped; its free raises glibc's threshold
    del a
    b = np.ones(2 << 20, np.float32)   # 8 MiB: from the heap once the threshold is raised
    del b
print(rss_bytes() - base)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc only")
def test_fixed_mmap_threshold_gives_freed_arrays_back():
    """PURINE_MMAP_THRESHOLD fixes glibc's threshold at start-up: a freed
    8 MiB array no longer stays resident (glibc's dynamic one keeps it)."""
    def kept(value):
        env = dict(os.environ, PURINE_MMAP_THRESHOLD=value)
        p = subprocess.run([sys.executable, "-c", _FREED], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=120)
        assert p.returncode == 0, p.stderr
        return int(p.stdout.split()[-1])
    assert kept("0") >= 7 << 20
    assert kept("131072") < 2 << 20


#: four threads alive at once, each allocating, then glibc's ``malloc_info``
#: (XML, one ``<heap nr=...>`` per arena) read through ctypes
_ARENAS = """
import ctypes, os, sys, tempfile, threading
import purine_mpi
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
barrier = threading.Barrier(5)
def work():
    kept = [bytearray(4096) for _ in range(64)]
    barrier.wait()
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
barrier.wait()
path = os.path.join(tempfile.mkdtemp(), "malloc_info.xml")
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
barrier.wait()
for t in threads:
    t.join()
print(open(path).read().count("<heap nr="))
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc only")
def test_one_malloc_arena_by_default():
    """Every command runs with one glibc malloc arena (PURINE_MALLOC_ARENAS,
    default 1, set when purine_mpi is imported): worker threads that
    allocate share it, so one thread's freed temporaries serve the others.
    PURINE_MALLOC_ARENAS=0 and the user's own MALLOC_ARENA_MAX leave glibc's
    setting alone (one arena per thread here, up to 8 per core)."""
    def heaps(**set_vars):
        env = {k: v for k, v in os.environ.items()
               if k not in ("PURINE_MALLOC_ARENAS", "MALLOC_ARENA_MAX")}
        env.update(set_vars)
        p = subprocess.run([sys.executable, "-c", _ARENAS], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=120)
        assert p.returncode == 0, p.stderr
        return int(p.stdout.split()[-1])
    assert heaps() == 1
    assert heaps(PURINE_MALLOC_ARENAS="1") == 1
    assert heaps(PURINE_MALLOC_ARENAS="0") == 5
    assert heaps(MALLOC_ARENA_MAX="3") == 3
    assert heaps(MALLOC_ARENA_MAX="8", PURINE_MALLOC_ARENAS="1") == 5


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux's pagemap")
def test_mapped_resident_bytes_counts_the_touched_pages():
    """base/rss.mapped_resident_bytes: the pages of an array present in this
    process's page table, whole pages: none of a fresh mapping, those a
    write touched, all of it once filled."""
    import mmap
    from purine_mpi.base.rss import mapped_resident_bytes
    page = os.sysconf("SC_PAGE_SIZE")
    m = mmap.mmap(-1, 64 * page)
    a = np.frombuffer(m, np.uint8)
    assert mapped_resident_bytes(a) == 0
    a[3 * page + 1:10 * page - 1] = 1       # pages 3..9
    assert mapped_resident_bytes(a) == 7 * page
    assert mapped_resident_bytes(a[5 * page:]) == 5 * page
    a[:] = 2
    assert mapped_resident_bytes(a) == 64 * page
    del a
    m.close()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux's pagemap")
def test_peer_window_pages_are_the_peers_windows_row(tmp_path):
    """A 2-stage pipeline on one node moves its activations and gradients
    through a shared window: each stage stores into or loads from the other's
    regions, whose pages are then resident in both processes, while plan
    counts a region once, on its owner (its ``windows`` row). memory.json's
    ``peer_window_bytes`` is those pages: on each rank the other rank's
    ``windows`` row, rounded up to whole pages (cifar10_quick: 0.78 MiB
    each way; gpt_tiny's 2 stages 10.3 and 4.1 MiB), and plan's JSON
    ``peer_window_pages`` (runtime/footprint.peer_window_bytes, the figure
    beside the rows that the rank's resident bytes count) is them to the
    page."""
    res = rss_vs_plan.measure("cifar10_quick", "pipeline", str(tmp_path), iters=2,
                              plan_with=run_cli_here)
    assert "error" not in res, res
    windows = {r: k["host"]["windows"] for k in res["plan"]["ranks"] for r in k["ranks"]}
    assert windows[0] > 0 and windows[1] > 0
    for r in (0, 1):
        got = res["peer_window"][r]
        assert windows[1 - r] <= got <= windows[1 - r] + (64 << 10), (r, got, windows)
        assert res["peer_window_planned"][r] == got, (r, res["peer_window_planned"], got)
        assert res["predicted_resident"][r] == res["predicted"][r] + got


def test_peer_window_bytes_counts_each_page_a_rank_accesses_once():
    """runtime/footprint.peer_window_bytes: of the other ranks' regions in a
    shared window, those the rank is a peer of (notify words too), whole
    pages of each owner's segment, a page two regions share once; not its
    own regions, not those it does not access, not an RMA window's (another
    node's: not mapped)."""
    from purine_mpi.comm.window_layout import ALIGN, WindowLayout
    from purine_mpi.runtime.footprint import peer_window_bytes
    page = 4096
    lay = WindowLayout()
    lay.add_word("w", 1, peers=[0])                      # 8 bytes at 0 of rank 1's
    lay.add("a", 1, (1000,), "float32", peers=[0])      # 4000 bytes after the word
    lay.add("b", 1, (3 * page,), "uint8", peers=[0])    # 3 pages after a
    lay.add("c", 1, (5 * page,), "uint8", peers=[2])    # rank 0 does not access it
    lay.add("d", 0, (page,), "uint8", peers=[1])        # rank 0's own
    lay.add("e", 3, (page,), "uint8", peers=[0])        # on another node: RMA
    comp = SimpleNamespace(window_placement=(lay, {0: 0, 1: 0, 2: 0, 3: 1}))
    lay.place({0: 0, 1: 0, 2: 0, 3: 1})
    spans = [(r.offset, r.offset + r.nbytes) for r in (lay.words["w"], lay.regions["a"],
                                                       lay.regions["b"])]
    assert spans[0][0] == 0 and ALIGN <= spans[1][0] and spans[2][1] > 3 * page
    pages = {p for a, b in spans for p in range(a // page, -(-b // page))}
    # the word and a share page 0, b is pages 1-3
    assert peer_window_bytes(comp, 0, page) == len(pages) * page == 4 * page
    assert peer_window_bytes(comp, 2, page) == 5 * page      # c alone
    assert peer_window_bytes(comp, 1, page) == page          # d
    assert peer_window_bytes(SimpleNamespace(), 0, page) == 0


def test_one_group_of_every_rank_makes_no_communicator():
    """World.split_groups with one group of every rank (2-way tensor
    parallelism on 2 ranks: the tensor group is the world) makes no
    communicator: group_comm gives the world's own, and a split would be
    one never used whose MPICH objects the node leader holds unplanned
    (1.79 MiB on gpt_tiny's tensor rank 0: docs/running.md, "Will it
    fit?"). Groups that divide the world split it, once."""
    from purine_mpi.comm.world import World
    calls = []
    comm = SimpleNamespace(Split=lambda color, key: calls.append((color, key)) or f"sub{color}")
    w = World.__new__(World)
    w.comm, w.rank, w.size, w.groups, w._splits = comm, 1, 2, {}, set()
    w.split_groups([[0, 1]])
    w.split_groups([[0, 1]])
    assert calls == [] and w.group_comm([1, 0]) is comm
    w.split_groups([[0], [1]])
    w.split_groups([[0], [1]])
    assert calls == [(1, 1)] and w.group_comm([1]) == "sub1"


#: run in a fresh process: ``train`` (argv[2:]) with tracemalloc started at
#: memory.json's baseline and, after the last iteration (the dispatcher
#: drained), the bytes of NumPy's array data it traces live (NumPy's own
#: tracemalloc domain) written to argv[1]
_NUMPY_AT_LOOP_END = """
import json, sys, tracemalloc
import numpy as np
sys.path.insert(0, "benchmarks")
import rss_vs_plan
out = sys.argv[1]
def at_end(rank):
    from purine_mpi.ops import hostgemm
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    with open(out, "w") as f:
        json.dump([sum(t.size for t in snap.traces), hostgemm.held_bytes(),
                   hostgemm.planned_threads(), hostgemm.threads()], f)
sys.argv = ["purine_mpi"] + sys.argv[2:]
rss_vs_plan.run_hooked(lambda: tracemalloc.start(1), at_end)
"""


@pytest.mark.parametrize("job,sets", [
    ("gpt_tiny", ["data.train.batch_size=8"]),
    ("cifar10_quick", ["data.train.batch_size=20"]),
])
def test_every_array_held_after_an_iteration_is_in_a_row(job, sets, tmp_path, email_h5,
                                                         monkeypatch):
    """The NumPy array bytes a one-rank run made after memory.json's
    baseline and holds after its last iteration (tracemalloc, NumPy's
    domain) are plan's host rows less the kernel temporaries (freed by
    then) to within 4 KiB (0.6 KiB measured on gpt_tiny: a few scalars
    and small vectors), the host products' K-cut pieces included
    (ops/hostgemm.held_bytes, in the host scratch row since 2026-11-30:
    cifar10_quick's conv3 weight gradient, 200 KiB; before, 'assert 204864
    <= 4096'). Where the run picked fewer threads than plan assumes (the
    most it may pick: hostgemm.planned_threads), the pieces it keeps may be
    fewer than planned: their difference is allowed. (A test split's host
    scratch is held from its first pass on, after the loop here:
    cifar10_quick has none; gpt_tiny's attention reads the one mask the
    training graph's made.) Before the causal mask was one per process,
    each host attention kernel kept its own and its transpose, unplanned:
    gpt_tiny's arrays were 721472 bytes more than the rows, 'assert 721472
    <= 4096'; before average pooling's dense matrices were shared Holds
    (ops/pool._dense_hold), cifar10_quick's two (69632 bytes) were in no
    row."""
    path = os.path.join(ROOT, "jobs", f"{job}.yaml")
    if job.startswith("gpt"):
        data = _text_data(tmp_path, email_h5)
        sets = sets + [f"data.train.path={data}", f"data.test.path={data}"]
    sets = sets + ["solver.test_interval=0", "solver.test_iter=1", "checkpoint.interval=0"]
    args = [a for s in sets for a in ("--set", s)]
    p = run_cli_here("plan", path, "--np", "1", "--json", *args)
    assert p.returncode == 0, p.stderr
    host = json.loads(p.stdout)["ranks"][0]["host"]
    planned = host["loop_total"] - host["kernel_temporaries"]
    out = tmp_path / "numpy.json"
    t = subprocess.run([sys.executable, "-c", _NUMPY_AT_LOOP_END, str(out), "train", path,
                        "--out", str(tmp_path / "run"), "--iters", "1"] + args,
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert t.returncode == 0, t.stderr[-3000:]
    held, products, most, used = json.loads(out.read_text())
    fewer = 0
    if used < most:   # fewer threads than planned: maybe fewer pieces kept
        from purine_mpi.ops import hostgemm
        monkeypatch.setattr(hostgemm, "THREADS", used)
        p = run_cli_here("plan", path, "--np", "1", "--json", *args)
        fewer = host["host_scratch"] - json.loads(p.stdout)["ranks"][0]["host"]["host_scratch"]
    assert abs(held + fewer - planned) <= 4096, (job, held, products, planned, fewer,
                                                 held + fewer - planned)
