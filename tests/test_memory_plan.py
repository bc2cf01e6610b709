"""The host memory plan (runtime/memory_plan.py): transient blobs share one
arena, no two blobs whose lifetimes meet share a byte (checked from the plan
and the schedule, on the jobs' graphs and on random graphs run on several
threads), what the host reads keeps its own memory, and training with the
plan is bitwise the same as with one buffer per blob -- the digits,
cifar10_quick, NIN, data-parallel, pipeline and hybrid jobs, with the test
graph, checkpoints, resume and --profile."""
import json
import os
import random

import h5py
import numpy as np
import pytest
import yaml

from purine_mpi.graph.core import Graph, reachable
from purine_mpi.tools.graph import compose_for, render_graph
from purine_mpi.job.config import resolve_config
from purine_mpi.runtime.dispatcher import EventDispatcher, SerialDispatcher
from purine_mpi.runtime.memory_plan import (HOST_ALIGN, batch_blobs, check_plan,
                                            plan_memory)
from purine_mpi.runtime.workspace import Workspace
from purine_mpi.train.trainer import Trainer

from .conftest import (REPO, FakeWorld, make_job, run_cli_args, run_cli_here, run_mpi_cli,
                       write_config_file)


def _job(name, **sets):
    with open(os.path.join(REPO, "jobs", name)) as f:
        cfg = yaml.safe_load(f)
    for key, value in sets.items():
        node = cfg
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    return cfg


def _schedule_conflicts(graph, plan):
    """Pairs of planned roots that share bytes while their lifetimes (first
    to last op in the schedule) overlap: what a plan must never contain,
    checked from the offsets and the schedule alone."""
    bad = []
    roots = sorted(plan.offsets)
    for i, a in enumerate(roots):
        for b in roots[i + 1:]:
            bytes_meet = plan.offsets[a] < plan.offsets[b] + plan.sizes[b] and \
                plan.offsets[b] < plan.offsets[a] + plan.sizes[a]
            (fa, la), (fb, lb) = plan.lifetimes[a], plan.lifetimes[b]
            # in place: the op that reads one last writes the other
            touching = (la == fb and plan.in_place.get(b, (None,))[0] == a) or \
                (lb == fa and plan.in_place.get(a, (None,))[0] == b)
            if bytes_meet and fa <= lb and fb <= la and not touching:
                bad.append((a, b))
    return bad


def _assert_sound(graph, plan):
    assert _schedule_conflicts(graph, plan) == []
    assert check_plan(graph, plan) == []
    for root, off in plan.offsets.items():
        assert off % HOST_ALIGN == 0 and off + plan.sizes[root] <= plan.total_bytes
    # the lifetimes are those of the schedule the plan names
    pos = {n: i for i, n in enumerate(plan.order)}
    prod, cons = graph.producers(), graph.consumers()
    for root, (first, last) in plan.lifetimes.items():
        names = [b for b in graph.blobs if graph.storage_root(b) == root]
        writes = [pos[o.name] for b in names for o in prod.get(b, ())]
        touches = writes + [pos[o.name] for b in names for o in cons.get(b, ())]
        assert first == min(writes) and last == max(touches)


# ------------------------------------------------------------- the plans
@pytest.mark.parametrize("job,np_,sets", [
    ("digits_lenet.yaml", 1, {}),
    ("digits_lenet.yaml", 2, {}),
    ("cifar10_quick.yaml", 1, {"data.train.batch_size": 8}),
    ("nin_cifar10.yaml", 1, {"data.train.batch_size": 2}),
    ("digits_pipeline.yaml", 2, {}),
    ("digits_hybrid.yaml", 4, {}),
])
def test_job_plans_are_sound(job, np_, sets, digits_h5):
    if job.startswith("digits"):
        sets = dict(sets, **{"data.train.path": digits_h5, "data.test.path": digits_h5})
    cfg = resolve_config(_job(job, **sets), check_files=False)
    for rank in range(np_):
        for phase in ("train", "test"):
            graph = compose_for(make_job(cfg), np_, rank, phase)
            if graph is None:
                continue
            order = [op.name for op in graph.topo_order()]
            plan = plan_memory(graph, keep=batch_blobs(graph), order_ops=True)
            _assert_sound(graph, plan)
            assert plan.offsets, (job, rank, phase)
            # the edges keep the schedule: each from an op to a later one of its thread
            assert [op.name for op in graph.topo_order()] == order == plan.order
            for a, b in plan.edges:
                assert order.index(a) < order.index(b)
                assert graph.ops[a].thread == graph.ops[b].thread
                assert a in graph.ops[b].control_inputs
            if phase == "train":
                assert plan.total_bytes < plan.unplanned_bytes
            kinds = {graph.blobs[b].kind for b in graph.blobs
                     if graph.storage_root(b) in plan.offsets}
            assert not kinds & {"param", "state", "lr", "iter", "bucket", "param_buffer"}
            for b in graph.blobs.values():  # losses and metrics are read after the iteration
                if "loss_weight" in b.attrs or b.attrs.get("metric"):
                    assert graph.storage_root(b.name) in plan.persistent


def test_what_the_host_reads_keeps_its_memory(digits_h5):
    cfg = resolve_config(_job("digits_lenet.yaml", **{"data.train.path": digits_h5,
                                                      "data.test.path": digits_h5}),
                         check_files=False)
    g = compose_for(make_job(cfg), 1, 0)
    plan = plan_memory(g, keep=["fc1"])
    assert plan.persistent["fc1"] == "read by the host (fc1)"
    assert plan.persistent["iter"].startswith("kind iter")
    assert plan.persistent["conv1/weight"].startswith("kind param")
    assert plan.persistent["loss"] == "a loss (loss)"
    assert "fc2" in plan.offsets and "conv1" in plan.offsets
    assert "fc1" in plan_memory(g).offsets
    # two ranks: the gradient buckets are allreduced in the deferred tail
    g2 = compose_for(make_job(cfg), 2, 0)
    plan2 = plan_memory(g2)
    assert not any(g2.blobs[r].kind == "bucket" for r in plan2.offsets)
    assert any(g2.blobs[r].kind == "bucket" for r in plan2.persistent)


def test_graph_memory_prints_the_plan(tmp_path):
    cfg = resolve_config(_job("cifar10_quick.yaml"), check_files=False)
    text = render_graph(make_job(cfg), 1, 0, memory=True)
    g = compose_for(make_job(cfg), 1, 0)
    plan = plan_memory(g, keep=batch_blobs(g), order_ops=True)
    assert (f"memory plan: {len(plan.offsets)} transient blob(s) in a {plan.total_bytes:,}-byte "
            f"arena") in text
    lines = {line.split()[0]: line for line in text.splitlines()[1:] if line.startswith("  ")}
    first, last = plan.lifetimes["conv1"]
    assert lines["conv1"].split()[1:4] == [f"{plan.offsets['conv1']:,}",
                                           f"{plan.sizes['conv1']:,}", f"{first}..{last}"]
    assert "persistent: kind param" in lines["conv1/weight"]
    off = render_graph(make_job(dict(cfg, memory_plan=False)), 1, 0, memory=True)
    assert "memory plan: off (memory_plan: false)" in off
    res = run_cli_here("graph", write_config_file(tmp_path, _job("cifar10_quick.yaml")),
                       "--memory")
    assert res.returncode == 0, res.stderr
    assert "memory plan: " in res.stdout and "persistent: kind param" in res.stdout


# ---------------------------------------------------------- random graphs
def _random_graph(seed, n_ops=40, threads=2, copies=False):
    """Sum ops over earlier blobs of one length (three lengths), on
    ``threads`` threads, with random control edges; sources are filled by
    the host, sinks are kept (read after the iteration). ``copies``: most
    Sums write their bfloat16 bits too (``bits_copy``: y may go over a
    term, ``Sum.in_place_of``), some read one blob twice (x + x)."""
    rng = random.Random(seed)
    g = Graph(f"random{seed}")
    lengths = [rng.choice([3, 17, 64, 200]) for _ in range(3)]
    pool = {n: [] for n in lengths}
    for i, n in enumerate(lengths):
        for j in range(2):
            name = f"src{i}_{j}"
            g.add_blob(name, shape=(n,))
            pool[n].append(name)
    for k in range(n_ops):
        n = rng.choice(lengths)
        ins = rng.sample(pool[n], min(len(pool[n]), rng.randint(1, 3)))
        out = f"b{k}"
        g.add_blob(out, shape=(n,))
        control = rng.sample(list(g.ops), min(len(g.ops), rng.randint(0, 1)))
        if rng.random() < 0.3:  # element-wise, may run in place over its input
            g.add_op(f"op{k}", "Relu", ins[:1], [out], thread=rng.randrange(threads),
                     control_inputs=control, attrs={"negative_slope": rng.choice([0.0, 0.5])})
        elif copies and rng.random() < 0.7:
            if rng.random() < 0.3:
                ins = ins + [ins[0]]
            g.add_blob(f"{out}@bf16", shape=(n,), dtype="uint16")
            g.add_op(f"op{k}", "Sum", ins, [out, f"{out}@bf16"], thread=rng.randrange(threads),
                     control_inputs=control, attrs={"bits_copy": [0], "bits_out": [1]})
        else:
            g.add_op(f"op{k}", "Sum", ins, [out], thread=rng.randrange(threads),
                     control_inputs=control)
        pool[n].append(out)
    g.infer_shapes().validate()
    cons = g.consumers()
    sinks = [b for b in g.blobs if not cons.get(b)]
    return g, sinks


def _assert_runs_bitwise(g, plan, sinks, seed):
    """The sinks of ``g`` (sources seeded by ``seed``) after 3 iterations
    are bit for bit the same with no plan (serial), and with ``plan`` run by
    the threaded and the serial dispatcher."""
    results = []
    for planned, kind in ((None, SerialDispatcher), (plan, EventDispatcher),
                          (plan, SerialDispatcher)):
        ws = Workspace(g, plan=planned)
        if planned is not None:  # stale bytes in the arena must never reach a result
            ws.host_arena[...] = 255
        rs = np.random.default_rng(seed)
        for b in g.blobs:
            if b.startswith("src"):
                ws.set(b, rs.standard_normal(g.blobs[b].shape).astype(np.float32))
        d = kind(g, workspace=ws)
        try:
            for it in range(3):
                d.run(it)
        finally:
            d.close()
        results.append({b: ws[b].copy() for b in sinks})
    for other in results[1:]:
        for b in sinks:
            assert np.array_equal(results[0][b], other[b]), (seed, b)


@pytest.mark.parametrize("seed", range(12))
def test_random_graphs_plan_soundly_and_run_bitwise(seed):
    g, sinks = _random_graph(seed)
    plan = plan_memory(g, keep=sinks, order_ops=seed % 2 == 0)
    _assert_sound(g, plan)
    for a, b in plan.edges:
        assert g.ops[a].thread == g.ops[b].thread
    assert plan.offsets and set(sinks) <= set(plan.persistent)
    for y, (x, op) in plan.in_place.items():
        assert plan.offsets[x] == plan.offsets[y] and g.ops[op].op_type == "Relu"
    _assert_runs_bitwise(g, plan, sinks, seed)


@pytest.mark.parametrize("seed", range(12))
def test_random_graphs_with_sums_over_their_terms_plan_soundly_and_run_bitwise(seed):
    """The random graphs with most Sums writing their bfloat16 bits
    (``bits_copy``: the sum may go over a term that dies there, term 0 or
    1), some over one blob twice: the plan is sound, a sum goes only over a
    term read once by it and by nothing after it, and the sinks (the sums'
    bits among them) are bit for bit those of no plan, run serially and by
    the threaded dispatcher."""
    g, sinks = _random_graph(seed, copies=True)
    plan = plan_memory(g, keep=sinks, order_ops=seed % 2 == 0)
    _assert_sound(g, plan)
    assert check_plan(g, plan) == []
    cons = g.consumers()
    deps = g.dependencies()
    for y, (x, op) in plan.in_place.items():
        o = g.ops[op]
        assert plan.offsets[x] == plan.offsets[y] and o.op_type in ("Relu", "Sum")
        if o.op_type == "Sum":
            assert o.attrs.get("bits_copy") and o.inputs.count(x) == 1 and \
                x in o.inputs[:2] and y == o.outputs[0]
            for r in cons[x]:   # every other reader of the term runs before the sum
                assert r.name == op or r.name in reachable(op, deps), (x, r.name, op)
    assert any(b.endswith("@bf16") for b in sinks)
    _assert_runs_bitwise(g, plan, sinks, seed)


def test_random_graphs_sum_over_their_terms_somewhere():
    graphs = [_random_graph(seed, copies=True) for seed in range(12)]
    planned = [(g, plan_memory(g, keep=sinks)) for g, sinks in graphs]
    over = [op for g, p in planned for _, op in p.in_place.values()
            if g.ops[op].op_type == "Sum"]
    assert len(over) >= 5, over
    assert any(g.ops[o].inputs.count(g.ops[o].inputs[0]) > 1 for g, _ in planned
               for o in g.ops if g.ops[o].op_type == "Sum")   # some x + x among them


def test_random_graphs_run_in_place_somewhere():
    planned = [plan_memory(g, keep=sinks) for g, sinks in map(_random_graph, range(12))]
    assert sum(len(p.in_place) for p in planned) > 0


def test_activations_are_computed_in_place(digits_h5):
    """NIN: each ReLU writes over its convolution's output (its gradient
    reads the ReLU's output), each ReluGrad over its dy; with control edges
    ordering a layer's weight gradient before the next data gradient (which
    the graph leaves unordered) the arena shrinks further; it is at most
    half of one buffer per blob (the job's batch of 128; the plan is only
    computed here)."""
    cfg = resolve_config(_job("nin_cifar10.yaml"), check_files=False)
    g = compose_for(make_job(cfg), 1, 0)
    live = plan_memory(g.copy(), keep=batch_blobs(g))
    plan = plan_memory(g, keep=batch_blobs(g), order_ops=True)
    _assert_sound(g, plan)
    assert plan.total_bytes < live.total_bytes and plan.edges and not live.edges
    assert plan.in_place["conv1@relu_conv1"] == ("conv1", "relu_conv1.fwd")
    assert plan.offsets["conv1@relu_conv1"] == plan.offsets["conv1"]
    assert plan.in_place["conv1.grad"] == ("conv1@relu_conv1.grad",
                                           "relu_conv1.bwd.relu_grad")
    grads = [op for op in g.ops.values() if op.op_type == "ReluGrad"]
    assert grads and all(op.inputs[1] == g.ops[op.name.split(".bwd")[0] + ".fwd"].outputs[0]
                         for op in grads)
    assert any(g.ops[op].op_type == "Dropout" for _, op in plan.in_place.values())
    assert plan.total_bytes <= plan.unplanned_bytes / 2


def test_unordered_blobs_never_share():
    """Two branches on two threads with nothing between them: every blob of
    one may run while any of the other does, so none shares bytes across."""
    g = Graph("branches")
    g.add_blob("x", shape=(100,))
    for t in (0, 1):
        prev = "x"
        for k in range(4):
            g.add_op(f"t{t}_{k}", "Scale", [prev], [f"t{t}_{k}"], attrs={"scale": 2.0},
                     thread=t)
            prev = f"t{t}_{k}"
    g.add_op("join", "Sum", ["t0_3", "t1_3"], ["y"])
    g.infer_shapes().validate()
    plan = plan_memory(g, keep=["y"], order_ops=True)
    _assert_sound(g, plan)
    assert all(g.ops[a].thread == g.ops[b].thread for a, b in plan.edges)
    for a in [f"t0_{k}" for k in range(4)]:
        for b in [f"t1_{k}" for k in range(4)]:
            assert plan.offsets[a] + plan.sizes[a] <= plan.offsets[b] or \
                plan.offsets[b] + plan.sizes[b] <= plan.offsets[a], (a, b)
    # within a branch, blobs two steps apart may share
    assert len(set(plan.offsets.values())) < len(plan.offsets)


# ------------------------------------------------- training, in process
def _train(raw, iters, plan):
    cfg = resolve_config(dict(raw, memory_plan=plan), check_files=False)
    t = Trainer(make_job(cfg), "/nonexistent-unused", world=FakeWorld(), log=lambda m: None)
    try:
        assert (t.ws.plan is not None) == plan
        losses = []
        for it in range(iters):
            t.step(it)
            t.train.drain()
            losses.append([t.ws[b].copy() for b in t.graphs.losses])
        state = {n: np.array(t.ws[n]) for n, b in t.graphs.graph.blobs.items()
                 if b.kind in ("param", "state") and b.alias_of is None}
        ev = t.evaluate(2) if t.test is not None else None
        return losses, state, ev, t.ws
    finally:
        t.close()


def _assert_same_training(raw, iters):
    got, ref = _train(raw, iters, True), _train(raw, iters, False)
    for it, (a, b) in enumerate(zip(got[0], ref[0])):
        for x, y in zip(a, b):
            assert np.array_equal(x, y), f"iteration {it}: loss {x} != {y}"
    assert sorted(got[1]) == sorted(ref[1]) and got[1]
    for n in ref[1]:
        assert np.array_equal(got[1][n], ref[1][n]), n
    assert got[2] == ref[2]
    ws, ws_ref = got[3], ref[3]
    assert ws.allocated_bytes < ws_ref.allocated_bytes
    assert ws.plan.planned_bytes < ws.plan.unplanned_bytes
    return ws


def test_cifar10_quick_trains_bitwise_with_and_without_the_plan():
    _assert_same_training(_job("cifar10_quick.yaml", **{"data.train.batch_size": 8}), 3)


def test_nin_trains_bitwise_with_and_without_the_plan():
    _assert_same_training(_job("nin_cifar10.yaml", **{"data.train.batch_size": 2}), 2)


def test_digits_with_micro_batches_trains_bitwise(digits_h5):
    raw = _job("digits_lenet.yaml", **{"data.train.path": digits_h5,
                                       "data.test.path": digits_h5,
                                       "parallel.micro_batches": 2})
    _assert_same_training(raw, 3)


# ------------------------------------------------------ training, the CLI
def _metrics(path):
    rows = [json.loads(x) for x in open(path)]
    clock = ("time", "timestamp", "images_per_s")
    return [{k: v for k, v in r.items() if k not in clock} for r in rows]


def _checkpoint(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _same_runs(a, b, metrics=True):
    ca, cb = _checkpoint(a / "latest.h5"), _checkpoint(b / "latest.h5")
    assert sorted(ca) == sorted(cb) and ca
    for name in ca:
        assert np.array_equal(ca[name], cb[name]), name
    if metrics:  # (a run stopped half way logs its last iteration too)
        assert _metrics(a / "metrics.jsonl") == _metrics(b / "metrics.jsonl")


def _cli_runs(tmp_path, raw, ranks):
    """Plan on, plan off, and plan on resumed from the on run's first
    checkpoint (a save changes no bit of the run: the state a run stopped
    there holds; before, a run stopped half way by --iters made it, one
    launch more; stopping and ``--resume auto``: test_consistency.py,
    test_mpi_train.py)."""
    path = write_config_file(tmp_path, raw)
    first = raw["checkpoint"]["interval"]
    assert first < raw["solver"]["max_iter"]

    def run(out, *extra):
        args = ("train", path, "--out", tmp_path / out) + extra
        res = run_mpi_cli(ranks, *args, timeout=300) if ranks > 1 else \
            run_cli_args(*args, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        return res
    on = run("on", "--profile")
    run("off", "--set", "memory_plan=false")
    run("resumed", "--resume", tmp_path / "on" / f"ckpt_{first}.h5")
    _same_runs(tmp_path / "on", tmp_path / "off")
    _same_runs(tmp_path / "on", tmp_path / "resumed", metrics=False)
    assert os.path.getsize(tmp_path / "on" / "trace.rank0.json") > 0
    return on


def test_digits_cli_bitwise_with_test_graph_checkpoints_resume_and_profile(tmp_path, digits_h5):
    raw = _job("digits_lenet.yaml", **{"data.train.path": digits_h5, "data.test.path": digits_h5,
                                       "solver.max_iter": 6, "solver.display": 2,
                                       "solver.test_interval": 2, "checkpoint.interval": 2})
    on = _cli_runs(tmp_path, raw, 1)
    memory = [line for line in on.stdout.splitlines() if line.startswith("  memory ")]
    assert len(memory) == 1 and "transient blobs planned into a" in memory[0]


@pytest.mark.mpi
@pytest.mark.parametrize("job,ranks", [
    ("digits_lenet.yaml", 2),      # data parallel: buckets, the deferred tail
    ("digits_pipeline.yaml", 2),
    ("digits_hybrid.yaml", 4),     # 2 replicas x 2 stages, 4 micro-batches
])
def test_parallel_jobs_bitwise_with_and_without_the_plan(tmp_path, digits_h5, job, ranks):
    raw = _job(job, **{"data.train.path": digits_h5, "data.test.path": digits_h5,
                       "solver.max_iter": 4, "solver.display": 2, "solver.test_interval": 2,
                       "checkpoint.interval": 2})
    _cli_runs(tmp_path, raw, ranks)


def test_graph_memory_shows_each_ops_scratch_and_its_note():
    """On a GPU, ``graph --memory`` ends with the device's scratch as
    ``plan`` counts it (runtime/footprint.device_extras): each op's bytes,
    its slot, and where the size comes from (``OpKernel.scratch_note``),
    then the cuBLAS workspaces."""
    from purine_mpi.runtime.footprint import device_extras
    cfg = resolve_config(_job("cifar10_quick.yaml"), check_files=False)
    cfg["device"] = 0
    job = make_job(cfg)
    text = render_graph(job, 1, 0, memory=True)
    extra = device_extras(compose_for(job, 1, 0), 0, job.cuda_graph)
    assert extra["ops"] and extra["slots"]
    assert (f"GPU 0 scratch: {len(extra['slots'])} slot(s), {extra['scratch']:,} bytes"
            in text)
    rows = {line.split()[0]: line for line in text.splitlines() if " bytes  slot " in line}
    assert set(rows) == set(extra["ops"])
    noted = 0
    for name, (nbytes, note) in extra["ops"].items():
        assert rows[name].split()[1] == f"{nbytes:,}"
        if note:
            noted += 1
            assert rows[name].endswith(f"({note})"), rows[name]
    assert noted > 0   # the convolutions say where their columns' size comes from
    assert (f"GPU 0 cuBLAS workspaces: {len(extra['cublas_handles'])} handle(s), "
            f"{extra['cublas_workspaces']:,} bytes") in text
    host = render_graph(make_job(resolve_config(_job("cifar10_quick.yaml"), check_files=False)),
                        1, 0, memory=True)
    assert "scratch:" not in host   # a CPU job has no device rows


def test_shared_colourings_answer_a_plan_of_the_same_content(monkeypatch, email_h5):
    """Within ``shared_colourings`` (``plan --choose``) the host plan of
    data parallelism's rank 1 (its graph rank 0's but for the ranks in
    its ops' locations and peers) takes rank 0's colouring: no ``_colour``
    call, and the plan is the one made outside the block, offsets, control
    edges and all (gpt_tiny: the plan orders ops apart); another batch is
    coloured again; nothing is kept past the block. (``plan --choose`` on
    gpt_small --np 2: 25 of its 52 plans shared.)"""
    from purine_mpi.job.config import load_job
    from purine_mpi.runtime import memory_plan as mp
    from purine_mpi.runtime.factory import memory_plans

    def plan(rank, batch=4):
        job = load_job(os.path.join(REPO, "jobs", "gpt_tiny.yaml"),
                       [f"data.train.batch_size={batch}", f"data.train.path={email_h5}",
                        f"data.test.path={email_h5}"], None, check_files=False)
        g = compose_for(job, 2, rank)
        host = memory_plans(g, keep=batch_blobs(g))[0]
        return (host.offsets, host.sizes, host.total_bytes, host.edges, host.lifetimes,
                host.in_place, host.persistent, {n: list(op.control_inputs)
                                                 for n, op in g.ops.items()})
    colours = []
    real = mp._colour
    monkeypatch.setattr(mp, "_colour", lambda *a, **k: colours.append(1) or real(*a, **k))
    want = plan(1)
    assert want[3] and len(colours) == 6  # edges: the comparison covers them
    with mp.shared_colourings():
        plan(0)
        assert len(colours) == 12
        assert plan(1) == want and len(colours) == 12  # rank 0's colouring
        plan(1, batch=2)
        assert len(colours) == 18
    assert not mp.SHARED_COLOURINGS.is_open


def test_the_test_graphs_loss_writes_its_probabilities_over_the_logits(email_h5):
    """gpt_tiny's test graph: the softmax loss waits for the accuracy, which
    reads the same logits and ends there (job/replica.py,
    ``_in_place_after_sinks``), so its probabilities take the logits' bytes
    (before: two buffers, GPT-2 124M's 2 x 6.1 GiB at a test batch of 32)."""
    from purine_mpi.job.replica import build_test_graph
    from purine_mpi.runtime.memory_plan import plan_memory
    cfg = resolve_config(_job("gpt_tiny.yaml"), overrides=[
        f"data.train.path={email_h5}", f"data.test.path={email_h5}"], check_files=False)
    g = build_test_graph(make_job(cfg))
    loss = next(op for op in g.ops.values() if op.op_type == "SoftmaxLoss")
    accuracy = next(op for op in g.ops.values() if op.op_type == "Accuracy")
    assert accuracy.inputs[0] == loss.inputs[0] and accuracy.name in loss.control_inputs
    plan = plan_memory(g, keep=batch_blobs(g), order_ops=True)
    _assert_sound(g, plan)
    assert plan.in_place[loss.outputs[1]] == (loss.inputs[0], loss.name)
