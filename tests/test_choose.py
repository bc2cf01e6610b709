"""plan --np N --choose (tools/choose.py) and parallel.scheme: auto.

The net: two 1,536-wide fully connected layers of equal size (9 MiB of
weights each, with their gradients and momentum 27 MiB), so a pipeline of
2 stages cut between them (the cut of equal measured time) holds about half
the model state per rank, while data parallelism and ZeRO stage 1 hold
nearly all of it. With --host-memory between the two, the best setting is a
pipeline by construction and the table marks data parallelism as not
fitting."""
import json
import re

import pytest
import yaml

from tests.conftest import run_cli_args, run_cli_here, run_mpi_cli

NET = """name: choose_net
seed: 3
data:
  train: {source: synthetic, shape: [1, 8, 8], classes: 10, num_samples: 256, batch_size: 16}
net:
  - {type: fc, name: fc1, bottom: data, top: fc1, num_output: 1536}
  - {type: relu, name: relu1, bottom: fc1, top: fc1}
  - {type: fc, name: fc2, bottom: fc1, top: fc2, num_output: 1536}
  - {type: relu, name: relu2, bottom: fc2, top: fc2}
  - {type: fc, name: fc3, bottom: fc2, top: fc3, num_output: 1536}
  - {type: fc, name: fc4, bottom: fc3, top: fc4, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc4, label], top: loss}
solver: {type: sgd, base_lr: 0.01, momentum: 0.9, max_iter: 100, display: 1}
parallel: {scheme: SCHEME}
"""


#: the keys of a ``not_tried`` entry of ``plan --choose --json``
NOT_TRIED_KEYS = {"label", "set", "micro_batches", "variant_of", "reason", "why"}


def _job(tmp_path, scheme="data"):
    path = tmp_path / f"{scheme}.yaml"
    path.write_text(NET.replace("SCHEME", scheme))
    return path


def _choose(job, cal, *extra, np=2):
    res = run_cli_here("plan", job, "--np", np, "--choose", "--json", "--calibration", cal,
                       *extra)
    assert res.returncode in (0, 2), res.stderr
    return json.loads(res.stdout), res


#: the constructed calibration's op law: each op takes fixed + rate x its
#: work (``scaling/work.op_work``: FLOPs, batch bytes, or all bytes for an
#: update), the ops ``GAP`` apart, ``AFTER`` seconds of loop between
#: iterations, local adds at ``ADD`` seconds per byte
FIXED, GAP, AFTER, ADD = 50e-6, 30e-6, 4e-3, 1e-10
RATE = {"flops": 2e-11, "bytes": 1e-9, "all bytes": 1e-10}


def _op_cost(graph, name):
    from purine_mpi.tools.scaling.work import op_work
    unit, work = op_work(graph, name)
    return FIXED + RATE[unit] * work


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """The job, its calibration file and the first --np 2 choice. The file
    is constructed (``_write_calibration`` at ``_op_cost``), not measured:
    what these tests read of it (the pipeline's cut of equal time, so its
    memory; the node correction's ratios; which settings the simulation
    completes) is then the same on every run, whatever the machine's load.
    Measuring is test_an_old_calibration_file_is_measured_again's and
    test_scheme_auto_chooses_the_same_on_every_rank_and_trains'."""
    tmp = tmp_path_factory.mktemp("choose")
    job, cal = _job(tmp), tmp / "cal.json"
    _write_calibration(job, cal, _op_cost, gap=GAP, after=AFTER, add=ADD)
    free, first = _choose(job, cal)
    return job, cal, free, first


def test_choose_splits_a_net_too_big_for_one_rank(tmp_path, calibrated, monkeypatch):
    job, cal, free, first = calibrated
    # the tight choice is made once: the --json run's Choice is the one the
    # text table's run prints (the same job, ranks, limit and calibration;
    # that a choice is the same on every run is
    # test_choose_predicts_the_same_figures_on_every_run's)
    import purine_mpi.tools.choose as choose_mod
    real_choose, made = choose_mod.choose, {}

    def choose_once(path, overrides, n, limits, *args, **kwargs):
        key = (str(path), tuple(overrides), n, repr(limits))
        if key not in made:
            made[key] = real_choose(path, overrides, n, limits, *args, **kwargs)
        return made[key]
    monkeypatch.setattr(choose_mod, "choose", choose_once)
    # the constructed calibration is read, not measured again
    assert "calibration: timing" not in first.stderr and first.returncode == 0
    rows = [r for r in free["candidates"] if "error" not in r]
    staged = [r for r in rows if r["label"].startswith("pipeline")]
    whole = [r for r in rows if not r["label"].startswith("pipeline")]
    assert staged and whole
    least_staged = min(r["need_bytes"]["host"] for r in staged)
    least_whole = min(r["need_bytes"]["host"] for r in whole)
    # the model state split in two, against data parallelism's whole copy
    # (sharded stage 1 holds less than data since its gradient shard is the
    # bucket's own range: 48.9 against 58.5 MB here, pipeline 30.0); rank
    # 0's checkpoint save adds the buffer stage 1's parameters stream
    # through (fc3's weight and momentum, one at a time: 9.4 MB; sharded's
    # largest bucket's momentum, 9.4): pipeline 39.4, sharded 58.3
    data = min(r["need_bytes"]["host"] for r in whole if r["label"].startswith("data"))
    assert least_staged < 0.7 * data
    assert least_staged < least_whole
    limit = (least_staged + least_whole) // 2
    # the second run reads the calibration from the cache: no new measurement
    tight, second = _choose(job, cal, "--host-memory", limit, "--out", tmp_path / "best.yaml")
    assert "calibration: timing" not in second.stderr
    assert second.returncode == 0
    cands = tight["candidates"]
    by_label = {r["label"]: r for r in cands}
    assert by_label["data, recompute none"]["fits"] is False
    assert all(not r["fits"] for r in cands if "error" not in r and
               not r["label"].startswith("pipeline"))
    assert tight["best"][0] == "parallel.scheme=pipeline"
    # sorted: what fits first, by predicted throughput; then what does not;
    # then the unranked (parameter servers: tools/choose.PS_NOT_VALIDATED); then refusals
    possible = [r for r in cands if "error" not in r]
    ranked = [r for r in possible if r["ranked"]]
    assert possible[:len(ranked)] == ranked
    fits = [r["fits"] for r in ranked]
    assert fits == sorted(fits, reverse=True)
    rates = [r["samples_per_s"] for r in ranked if r["fits"]]
    assert rates == sorted(rates, reverse=True)
    errors = [i for i, r in enumerate(cands) if "error" in r]
    assert errors == list(range(len(cands) - len(errors), len(cands)))
    # the text table says the same, and the best as --set options
    assert len(made) == 1
    text = run_cli_here("plan", job, "--np", 2, "--choose", "--calibration", cal,
                        "--host-memory", limit)
    assert text.returncode == 0, text.stderr
    assert len(made) == 1  # the JSON run's choice
    lines = text.stdout.splitlines()
    dp = next(line for line in lines if "data, recompute none" in line)
    assert "NO: host over" in dp
    # the best line (a note may follow it: ops of the best setting the
    # calibration's trace does not time, which depends on the timed run)
    best_line = next(line for line in lines if line.startswith("best: "))
    assert best_line.startswith("best: --set parallel.scheme=pipeline"), text.stdout
    # --out: the job with the best setting, which trains
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["parallel"]["scheme"] == "pipeline"
    assert sorted(set(best["parallel"]["stages"].values())) == [0, 1]
    res = run_mpi_cli(2, "train", tmp_path / "best.yaml", "--iters", 2, "--out",
                      tmp_path / "run", timeout=300)
    assert res.returncode == 0, res.stderr
    # the start-up block's scheme row (its label column is as wide as the
    # longest label: a 'micro-batches' row, there where the best's count is
    # more than 1, widens it; which count is best depends on the
    # calibration's op times)
    rows = dict(re.findall(r"^  (\S.*?)  +(\S.*)$", res.stdout, re.M))
    assert rows.get("scheme", "").startswith("pipeline"), res.stdout
    micro = best["parallel"].get("micro_batches", 1)
    assert ("micro-batches" in rows) == (micro > 1), (micro, res.stdout)


def test_choose_json_keys_are_those_formats_md_lists(calibrated):
    """Every key of ``plan --choose --json`` is named in docs/formats.md's
    paragraph on it, and every key named there is written."""
    from .test_docs import FORMATS_MD
    with open(FORMATS_MD, encoding="utf-8") as f:
        (para,) = [p for p in f.read().split("\n\n")
                   if p.startswith("`plan JOB.yaml --np N --choose --json`")]
    documented = set(re.findall(r'"(\w+)"', para))
    _, _, free, _ = calibrated
    written = set(free).union(*map(set, free["candidates"] + free["not_tried"]))
    assert written <= documented, written - documented
    # a not_tried entry's keys: test_choose_json_says_which_counts_were_not_tried
    assert documented - {"host", "error"} - NOT_TRIED_KEYS <= written, documented - written
    assert NOT_TRIED_KEYS <= documented


def test_choose_predicts_the_same_figures_on_every_run(tmp_path, calibrated):
    """A calibration gives the same prediction on every run, whatever the
    hash seed: two runs of ``plan --choose --json`` (processes of hash
    seeds 1 and 2) print equal figures, exactly (the host's add rate, timed
    anew at each start, made them differ in the fourth digit). The memory
    limits are left out: they are the free memory at the time."""
    import shutil
    import subprocess

    from tests.conftest import PYTHON, REPO, cli_env
    job, cal, _, _ = calibrated
    cal = shutil.copy(cal, tmp_path / "cal.json")
    outs = []
    for seed in ("1", "2"):
        res = subprocess.run([PYTHON, "-m", "purine_mpi", "plan", str(job), "--np", "2",
                              "--choose", "--json", "--calibration", str(cal)], cwd=REPO,
                             env=dict(cli_env(), PYTHONHASHSEED=seed), capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        for row in out["candidates"]:
            row.pop("limit_bytes", None)
        outs.append(out)
    assert any("iter_s" in row for row in outs[0]["candidates"])
    assert outs[0] == outs[1]


def test_choose_applies_a_network_files_node_measurements(tmp_path, calibrated):
    """``plan --choose --network LINK.json`` where the file measured ranks
    sharing a host (``node``, 2 ranks a host: every class 2 times slower,
    a millisecond per collective): at its default K (the file's 2) every
    possible setting of 2 ranks on a node is predicted slower than with
    ``--ranks-per-node 1`` (one rank a node: no correction, predict's rule;
    tests/test_scaling.py checks the figures equal predict's), those whose
    ranks compute in step more than 1.5 times, a pipeline of 1 micro-batch
    (its stages compute one after another) clearly less (before the
    contention of ranks computing at once, scaling/concurrent.py: every
    setting more than 1.5 times, the pipeline's too); without
    ``node`` the file gets predict's note on stderr, once."""
    from purine_mpi.tools.scaling.link import Link, save_link
    from purine_mpi.tools.scaling.node import CLASSES, NodeModel
    job, cal, _, _ = calibrated
    link, old = tmp_path / "node.json", tmp_path / "old.json"
    save_link(link, Link(1e-6, 1.2e10, 0.0, "test", node=NodeModel(
        {2: {c: 2.0 for c in CLASSES}}, {2: 1e-3}, ranks_per_node=2)))
    save_link(old, Link(1e-6, 1.2e10, 0.0, "test"))
    shared, res = _choose(job, cal, "--network", link)
    alone, _ = _choose(job, cal, "--network", link, "--ranks-per-node", 1)
    assert "holds no measurement" not in res.stderr
    assert "ranks sharing a node: 2 a node, each setting corrected" in res.stderr
    times = {}
    for out in (shared, alone):
        for row in out["candidates"]:
            if "iter_s" in row:
                times.setdefault(row["label"], []).append(row["iter_s"])
    assert times and all(len(t) == 2 for t in times.values()), times
    ratio = {k: t[0] / t[1] for k, t in times.items()}
    # replicas and tensor shards compute in step: the full ratio; a
    # pipeline's stages contend only while both compute (scaling/
    # concurrent.py): slower than alone, at one micro-batch (the stages one
    # after another) clearly less than the ranks computing in step
    in_step = {k: r for k, r in ratio.items() if k.startswith(("data", "sharded", "tensor"))}
    assert in_step and all(r > 1.5 for r in in_step.values()), ratio
    assert all(r > 1.0 for r in ratio.values()), ratio
    one_mb = [r for k, r in ratio.items() if k.startswith("pipeline") and "1 micro-batch" in k]
    assert one_mb and all(r < min(in_step.values()) - 0.2 for r in one_mb), ratio
    _, res = _choose(job, cal, "--network", old)
    assert res.stderr.count(f"--network {old} holds no measurement of ranks sharing a node") \
        == 1, res.stderr


def test_choose_on_4_ranks_lists_each_hybrid_setting_sharded_too(calibrated):
    """With fewer stages than ranks, each hybrid setting also appears with
    its stage's replicas sharded; shards 1 and 2 need less than the hybrid
    setting they shard (its replicas' whole optimizer state), a save
    counted: sharded with stages streams it to rank 0 a parameter at a
    time, as hybrid's pipeline does."""
    job, cal, _, _ = calibrated
    out, res = _choose(job, cal, np=4)
    assert res.returncode == 0 and "calibration: timing" not in res.stderr
    rows = {r["label"]: r for r in out["candidates"]}
    hybrid = [label for label in rows if label.startswith("hybrid 2 stages")]
    assert hybrid
    for label in hybrid:
        what = label[len("hybrid "):]
        assert "error" not in rows[label], rows[label]
        for stage in (1, 2, 3):
            assert f"sharded stage {stage} x {what}" in rows
        for stage in (1, 2):
            row = rows[f"sharded stage {stage} x {what}"]
            assert "error" not in row, row
            assert row["need_bytes"]["host"] < rows[label]["need_bytes"]["host"]
            assert row["set"][:2] == ["parallel.scheme=sharded", f"parallel.shard={stage}"]


def test_scheme_auto_chooses_the_same_on_every_rank_and_trains(tmp_path):
    job = _job(tmp_path, "auto")
    res = run_mpi_cli(2, "train", job, "--iters", 2, "--out", tmp_path / "run", timeout=600)
    assert res.returncode == 0, res.stderr
    chosen = [line for line in res.stdout.splitlines() if line.startswith("parallel.scheme auto:")]
    assert len(chosen) == 1 and "fastest predicted" in chosen[0]
    # the run's config is the chosen setting (the ranks agreed on it at start-up)
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert cfg["parallel"]["scheme"] != "auto"
    assert chosen[0].split(": ")[1].startswith(cfg["parallel"]["scheme"])
    assert (tmp_path / "run" / "calibration.json").exists()


def test_choose_options_and_auto_elsewhere_are_user_errors(tmp_path):
    res = run_cli_here("plan", _job(tmp_path), "--calibration", tmp_path / "c.json")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "belong to --choose" in res.stderr
    res = run_cli_here("graph", _job(tmp_path, "auto"), "--np", 2)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "parallel.scheme" in res.stderr and "--choose" in res.stderr


def test_selective_recompute_is_listed_without_effect_where_attention_is_fused(email_h5):
    """gpt_tiny's attention is the fused op: it keeps no (N, H, T, T)
    tensor (with attn_dropout or without), so ``recompute: selective`` is
    the run of ``none`` and the candidate says so rather than rank a copy
    of it; with the raw sub-graph (fused: false, attn_dropout > 0)
    selective is a setting of its own and plan counts less memory for it
    than for none."""
    import os
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.choose import Candidate, Choice, evaluate, format_choice, \
        selective_no_effect
    from purine_mpi.tools.plan import MemoryLimits, offline_footprint
    from tests.conftest import REPO
    tiny = os.path.join(REPO, "jobs", "gpt_tiny.yaml")
    small = (f"data.train.path={email_h5}", "data.test=null", "data.train.batch_size=4",
             "data.train.sequence_length=32")
    fused = load_job(tiny, small + ("recompute=selective",), check_files=False)
    assert "fused Attention" in selective_no_effect(fused)
    cand = evaluate(Candidate(("parallel.scheme=data", "recompute=selective"),
                              "data, recompute selective"), tiny, small, 2,
                    MemoryLimits(host=1 << 40), predictor=None)
    assert cand.error.startswith("no effect: ") and "fused" in cand.error
    line = format_choice(Choice(2, [cand], ("tokens", 32), "", 0.0)).splitlines()[-2]
    assert "no effect: " in line and "not possible" not in line
    dropped = small + tuple(f"net.{i}.attn_dropout=0.1" for i in (3, 11))
    assert "fused Attention" in selective_no_effect(
        load_job(tiny, dropped + ("recompute=selective",), check_files=False))
    raw = dropped + tuple(f"net.{i}.fused=false" for i in (3, 11))
    need = {}
    for mode in ("none", "selective"):
        job = load_job(tiny, raw + (f"recompute={mode}",), check_files=False)
        assert selective_no_effect(job) is None
        need[mode] = offline_footprint(job, 2, 0).host_total
    assert need["selective"] < need["none"]


def test_candidates_list_sharded_x_tensor_where_tensor_has_replicas(tmp_path):
    """Where tensor t-way is listed with replicas (t < N), sharded stage 1,
    2 and 3 x tensor t-way follow it; each composes offline on N ranks,
    each rank holding less optimizer state than the tensor setting it
    shards (stage 3: fewer weight bytes too)."""
    import yaml as _yaml

    from purine_mpi.runtime.footprint import model_state_bytes
    from purine_mpi.tools.choose import candidates
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.scaling.trace_reader import Durations
    from tests.conftest import make_job
    from tests.gpt_nets import gpt_config, text_h5
    cfg = gpt_config(text_h5(tmp_path), parallel={"scheme": "data"})
    labels = {c.label: c for c in candidates(make_job(cfg), 4, Durations({}))}
    assert {"tensor 2-way", "tensor 4-way"} <= set(labels)
    ours = sorted(label for label in labels if " x tensor " in label
                  and label.startswith("sharded"))
    assert ours == [f"sharded stage {s} x tensor 2-way" for s in (1, 2, 3)]

    def job_of(label):
        par = dict(cfg["parallel"])
        for item in labels[label].sets:
            key, value = item.split("=", 1)
            par[key.split(".", 1)[1]] = _yaml.safe_load(value)
        return make_job(dict(cfg, parallel=par))
    for label in ours:
        assert labels[label].after is labels["tensor 2-way"]
        held = model_state_bytes(compose_for(job_of(label), 4, 0))
        plain = model_state_bytes(compose_for(job_of("tensor 2-way"), 4, 0))
        assert held["optimizer_state"] < plain["optimizer_state"]
        assert (held["weights"] < plain["weights"]) == label.startswith("sharded stage 3")


def test_the_calibration_prices_its_own_job_as_traced(calibrated):
    """The two traced runs (the job's batch and a quarter of it) in the
    cache, and an affine cost fitted from them; the calibration job itself
    is still predicted at its traced iteration: its ops keep their traced
    times (the affine law passes through them) and the dispatch overhead is
    the rest of the iteration, not counted twice with the ops' fixed parts
    (those are inside the ops' durations). (The small job is not compared
    with its own trace here: the updates, of equal work at both batches,
    vary by a third between two runs on a loaded machine.)"""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.choose import Predictor, calibrate, small_batch
    from purine_mpi.tools.scaling.link import make_link
    job, cal, _, _ = calibrated
    data = json.loads(cal.read_text())
    assert data["small"]["batch"] == small_batch(16) == 4
    # each run's dispatcher gap per op and each op's least time, at most its median
    for run in (data, data["small"]):
        assert 0 <= run["gaps"]["0"] < run["iter_seconds"]["0"]
        assert set(run["fastest"]["0"]) == set(run["per_rank"]["0"])
        assert all(run["fastest"]["0"][op] <= t for op, t in run["per_rank"]["0"].items())
    durations, small, calib_job, _ = calibrate(load_job(job, (), check_files=False), job, (),
                                               str(cal))
    assert small[1].train_batch == 4 and calib_job.train_batch == 16
    link = make_link(None, None, None)
    affine = Predictor(calib_job, durations, link, small=small)
    proportional = Predictor(calib_job, durations, link)
    assert {"fc2.fwd", "fc3.bwd.inner_product_grad_data"} <= set(affine.fit)
    assert not proportional.fit
    traced = durations.iter_seconds[0]
    assert affine.overhead == proportional.overhead
    assert affine.per_iteration == proportional.per_iteration
    # the overhead is the rest of the traced iteration, never negative: the
    # job is predicted at its traced iteration, or at its ops' medians
    # scheduled where they take longer (a trace of a loaded machine:
    # test_a_noisy_calibration_trace_is_predicted_at_its_ops_medians)
    bare = Predictor(calib_job, durations, link, small=small)
    bare.overhead = bare.per_iteration = 0.0
    assert affine.predict(calib_job, 1)[0] == pytest.approx(
        max(traced, bare.predict(calib_job, 1)[0]), rel=1e-3)
    assert affine.predict(calib_job, 1)[0] == pytest.approx(proportional.predict(calib_job, 1)[0])


def _calibration_trace(calib_job, seconds, slow=None, gap=0.0, after=None):
    """The Durations the trace reader makes of a constructed traced window
    (``CALIBRATION_WINDOW``) of ``calib_job``: its ops one after another,
    each ``seconds`` long (a number, or a function of the graph and the op's
    name; ``slow``: {(op, iteration): seconds} instead), ``gap`` seconds
    apart (the dispatcher's cost per op), and after each iteration ``after``
    seconds more, by default a tenth of its ops' time (the trainer's loop)."""
    from purine_mpi.tools.choose import CALIBRATION_WINDOW
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.scaling.trace_reader import Durations, dispatch_gap, \
        median_durations, op_minima
    graph = compose_for(calib_job, 1, 0)
    names = [op.name for op in graph.topo_order(graph.dependencies())]
    cost = seconds if callable(seconds) else (lambda g, name: seconds)
    first, end = (int(v) for v in CALIBRATION_WINDOW.split(":"))
    if after is None:
        after = 0.1 * sum(cost(graph, n) for n in names)
    events, t = [], 0.0
    for it in range(first, end):
        for i, name in enumerate(names):
            dur = (slow or {}).get((name, it), cost(graph, name)) * 1e6
            events.append({"ph": "X", "name": name, "ts": t, "dur": dur, "args": {"iter": it}})
            t += dur + (gap * 1e6 if i < len(names) - 1 else 0.0)
        t += after * 1e6
    medians, period, n = median_durations(events)
    return Durations({0: medians}, {0: period}, n, {0: dispatch_gap(events)},
                     {0: op_minima(events)})


def test_a_noisy_calibration_trace_is_predicted_at_its_ops_medians(tmp_path):
    """The calibration job is predicted at its traced iteration where its
    ops' medians leave a remainder: the dispatcher's cost per op (the gap
    measured between two ops of an iteration) and the rest per iteration
    (the loop between iterations), the same with the affine law and
    without; a trace whose ops' medians, scheduled, take longer than its
    median iteration (fc2.fwd 20 times slower in two of the four iterations
    read, one of them the last, whose length the iteration median never
    sees: a loaded machine) gets no overhead, never a negative one, and is
    predicted at those medians, above its traced iteration."""
    from purine_mpi.tools.choose import Predictor, _calibration_job, small_batch
    from purine_mpi.tools.scaling.link import make_link
    path, link = _job(tmp_path), make_link(None, None, None)
    calib_job = _calibration_job(path, ())
    small_job = _calibration_job(path, (), (f"data.train.batch_size={small_batch(16)}",))
    clean = _calibration_trace(calib_job, 1e-3, gap=20e-6)
    small = (_calibration_trace(small_job, 0.5e-3, gap=20e-6), small_job)
    affine = Predictor(calib_job, clean, link, small=small)
    proportional = Predictor(calib_job, clean, link)
    assert affine.fit and not proportional.fit
    assert clean.gaps[0] == pytest.approx(20e-6)
    assert affine.overhead == proportional.overhead == pytest.approx(20e-6)
    assert affine.per_iteration == pytest.approx(proportional.per_iteration)
    assert affine.per_iteration > 0
    for p in (affine, proportional):
        assert p.predict(calib_job, 1)[0] == pytest.approx(clean.iter_seconds[0], rel=1e-6)
    noisy = _calibration_trace(calib_job, 1e-3, {("fc2.fwd", 4): 20e-3, ("fc2.fwd", 7): 20e-3})
    assert noisy.lookup("fc2.fwd") == pytest.approx(10.5e-3)
    assert noisy.iter_seconds[0] == pytest.approx(clean.iter_seconds[0] - 20e-6 * (
        len(clean.per_rank[0]) - 1))
    p = Predictor(calib_job, noisy, link)
    assert p.overhead == 0.0 and p.per_iteration == 0.0
    medians = sum(noisy.per_rank[0].values()) - noisy.lookup("data")  # the reader beside lane 0
    assert p.predict(calib_job, 1)[0] == pytest.approx(medians, rel=1e-6)
    assert medians > 1.05 * noisy.iter_seconds[0]


def test_a_micro_batched_iteration_is_priced_op_by_op_in_closed_form(tmp_path):
    """M micro-batches priced from two constructed traces whose every op
    takes fixed + rate x its work (``scaling/work.op_work``: FLOPs, batch
    bytes, or all bytes for an update), the ops ``gap`` apart, the loop
    ``after`` seconds between iterations. The fit gives each op's fixed
    part exactly, from each op's least time in a traced iteration (fc2.fwd
    slowed in half the small trace's iterations is fitted as the others);
    the dispatcher's cost per op is the gap, and the rest of the traced
    iteration (the reader's op beside the busiest lane, and the loop) is
    paid once an iteration. So an iteration of M micro-batches is that cost
    per iteration plus, over the busiest lane's ops and the readers of
    micro-batches 1..M-1 (each waits for the micro-batch before it), each
    op's fixed + rate x work + gap (a micro-batch's gradient sum, untraced,
    at the add rate 0 here: the gap alone). Spread over the ops as before
    (the calibration without its gaps), the once-an-iteration cost would
    be paid n_M / n_1 times over (n_M: the ops on the path at M
    micro-batches): 4 micro-batches priced that much more."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.choose import Predictor, _calibration_job, small_batch
    from purine_mpi.tools.scaling.link import make_link
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.scaling.model import Scenario, Template
    from purine_mpi.tools.scaling.work import op_work
    fixed, gap, after = 50e-6, 30e-6, 4e-3
    rate = {"flops": 2e-11, "bytes": 1e-9, "all bytes": 1e-10}

    def cost(graph, name):
        unit, work = op_work(graph, name)
        return fixed + rate[unit] * work
    path, link = _job(tmp_path), make_link(None, None, None)
    calib_job = _calibration_job(path, ())
    small_job = _calibration_job(path, (), (f"data.train.batch_size={small_batch(16)}",))
    big = _calibration_trace(calib_job, cost, gap=gap, after=after)
    # fc2.fwd of the small trace slowed in two of the four iterations read
    # (a loaded machine): its median is not its cost, its least time is
    graph = compose_for(small_job, 1, 0)
    late = {("fc2.fwd", it): 3 * cost(graph, "fc2.fwd") for it in (4, 7)}
    small = (_calibration_trace(small_job, cost, late, gap=gap, after=after), small_job)
    assert small[0].lookup("fc2.fwd") == pytest.approx(2 * cost(graph, "fc2.fwd"))
    p = Predictor(calib_job, big, link, small=small, add=0.0)
    traced = p.traced
    assert all(f[1] == pytest.approx(fixed, rel=1e-6) for f in p.fit.values())
    assert p.overhead == pytest.approx(gap, rel=1e-6)
    # what the traced iteration holds beside the busiest lane's ops and gaps
    assert p.per_iteration == pytest.approx(after + cost(traced, "data"), rel=1e-6)
    bare = Predictor(calib_job, type(big)(big.per_rank, big.iter_seconds, big.iterations),
                     link, small=small, add=0.0)
    predicted, spread, lane_ops = {}, {}, {}
    for m in (1, 2, 4):
        job = load_job(path, (f"parallel.micro_batches={m}",), check_files=False)
        graph = Template(job, Scenario(job, 1), 0).graph
        deps = graph.dependencies()
        lane = [n for n, op in graph.ops.items() if str(op.thread) == "0"]
        # a later micro-batch's reader (data@mbK, K >= 1) waits for the
        # previous micro-batch's weight gradients: on the path between them
        readers = [n for n, op in graph.ops.items() if str(op.thread) != "0" and deps[n]]
        assert len(readers) == m - 1
        expected = p.per_iteration
        for name in lane + readers:
            base = re.sub(r"(@mb\d+)+$", "", name)
            expected += gap + (cost(graph, name) if base in traced.ops else 0.0)
        predicted[m], spread[m] = p.predict(job, 1)[0], bare.predict(job, 1)[0]
        lane_ops[m] = len(lane + readers)  # the ops on the iteration's path
        assert predicted[m] == pytest.approx(expected, rel=1e-6), m
    assert lane_ops[4] > 3 * lane_ops[1]
    assert predicted[1] == pytest.approx(big.iter_seconds[0], rel=1e-6)
    assert spread[1] == pytest.approx(predicted[1], rel=1e-6)
    assert spread[4] - predicted[4] == pytest.approx(
        p.per_iteration * (lane_ops[4] / lane_ops[1] - 1), rel=1e-3)


def test_an_old_calibration_file_is_measured_again(tmp_path, monkeypatch):
    """A cache of the format before the second trace (no "format", no
    "small") under the job's own key is not read with half the law: it is
    measured again, both runs, and rewritten; the new file is then read."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools import choose
    from purine_mpi.tools.scaling.trace_reader import Durations
    path = _job(tmp_path)
    job = load_job(path, (), check_files=False)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"key": choose.calibration_key(job), "job": job.name,
                               "per_rank": {"0": {"fc1.fwd": 9.0}}, "iter_seconds": {"0": 9.0},
                               "iterations": 5, "measured_s": 1.0}))
    runs = []

    def traced_run(path, overrides, sets, folder):
        runs.append(tuple(sets))
        t = 0.25 if sets else 1.0
        return Durations({0: {"fc1.fwd": t}}, {0: t}, 5)
    monkeypatch.setattr(choose, "_traced_run", traced_run)
    lines = []
    durations, small, calib_job, add = choose.calibrate(job, path, (), str(cal), lines.append)
    assert runs == [(), ("data.train.batch_size=4",)]
    # why the file given was not used (trust71: before, the runs' line alone)
    assert lines[0] == f"calibration: {cal} is of calibration format 1 (this version reads " \
        f"format {choose.CALIBRATION_FORMAT}: op times as CPU time): measured again"
    lines.pop(0)
    assert "at batch 16 and 4" in lines[0]
    assert durations.lookup("fc1.fwd") == 1.0 and small[0].lookup("fc1.fwd") == 0.25
    data = json.loads(cal.read_text())
    assert data["format"] == choose.CALIBRATION_FORMAT and data["small"]["batch"] == 4
    assert data[choose.ADD_RATE_KEY] == add > 0
    # the rewritten file is read: no third run, the add rate it holds
    durations, small, _, again = choose.calibrate(job, path, (), str(cal), lines.append)
    assert len(runs) == 2 and len(lines) == 1 and small[0].lookup("fc1.fwd") == 0.25
    assert again == add
    # a file written before it kept the add rate: timed once and added to it
    del data[choose.ADD_RATE_KEY]
    cal.write_text(json.dumps(data))
    _, _, _, timed = choose.calibrate(job, path, (), str(cal), lines.append)
    assert len(runs) == 2 and timed > 0
    assert json.loads(cal.read_text())[choose.ADD_RATE_KEY] == timed
    # an odd batch: one trace, and the proportional rule
    odd = load_job(path, ("data.train.batch_size=15",), check_files=False)
    _, small, _, _ = choose.calibrate(odd, path, ("data.train.batch_size=15",),
                                      str(tmp_path / "odd.json"))
    assert small is None and runs[-1] == ()


def test_choose_lists_tensor_x_pipeline_prices_it_and_its_best_trains(tmp_path):
    """On 4 ranks a GPT gets scheme pipeline with 2 stages x 2-way tensor
    (parallel.tensor_parallel 2) at each micro-batch count of the 2-stage
    settings, cut where those are (here before b1_attn, the heaviest layer
    of a constructed calibration trace: the column-split attention's input
    crosses the cut, its gradient an allreduce's output sent back through a
    window). Each is priced by the predictor over all 4 ranks (Scenario):
    the tensor allreduces inside each stage are on its path (a slower link
    latency costs each of them at least the added latency), and it holds
    less per rank than tensor 2-way and than the hybrid of the same stages;
    under a host limit only it fits, it is the best, and the YAML written
    for it trains on 4 ranks."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.choose import Choice, Predictor, _calibration_job, best_yaml, \
        candidates, evaluate, format_choice, rank, small_batch
    from purine_mpi.tools.plan import MemoryLimits
    from purine_mpi.tools.scaling.link import make_link
    from purine_mpi.tools.scaling.model import Scenario
    from purine_mpi.tools.scaling.trace_reader import Durations
    from tests.gpt_nets import gpt_config, text_h5
    path = tmp_path / "gpt.yaml"
    path.write_text(yaml.safe_dump(gpt_config(text_h5(tmp_path), parallel={"scheme": "data"})))
    calib_job = _calibration_job(path, ())
    small_job = _calibration_job(path, (), (f"data.train.batch_size={small_batch(4)}",))

    def trace(job, seconds):
        d = _calibration_trace(job, seconds)
        return Durations({0: {k: v * (2 if k.startswith("b1_attn") else 1)
                              for k, v in d.per_rank[0].items()}}, d.iter_seconds, d.iterations)
    durations = trace(calib_job, 1e-3)
    small = (trace(small_job, 0.5e-3), small_job)
    job = load_job(path, (), check_files=False)
    cands = {c.label: c for c in candidates(job, 4, durations)}
    cut = "2 stages (wte|b1_attn)"
    ours = [label for label in cands if label.endswith(" x tensor 2-way")
            and label.startswith("pipeline")]
    assert ours == [f"pipeline {cut}, {m} micro-batch{'es' if m > 1 else ''} x tensor 2-way"
                    for m in (1, 2, 4)]
    hybrid = cands[f"hybrid {cut}, 1 micro-batch"]
    tppp = cands[ours[0]]
    assert tppp.sets == ("parallel.scheme=pipeline", hybrid.sets[1],
                         "parallel.micro_batches=1", "parallel.tensor_parallel=2",
                         "parallel.mode=sync")
    link = make_link(None, None, None)
    predictor = Predictor(calib_job, durations, link, small=small)
    free = MemoryLimits(host=1 << 40)
    for c in (tppp, hybrid, cands["tensor 2-way"]):
        evaluate(c, path, (), 4, free, predictor)
        assert c.error is None and c.iter_s > 0, c.error
    assert tppp.samples == 4  # one replica: the batch
    assert Scenario(tppp.job, 4).ranks == [0, 1, 2, 3]
    assert tppp.need["host"] < min(hybrid.need["host"], cands["tensor 2-way"].need["host"])
    # the tensor allreduces of both stages are on the iteration's path
    groups = {}
    from purine_mpi.tools.graph import compose_for
    for r in (0, 2):
        g = compose_for(tppp.job, 4, r)
        groups[r] = [op for op in g.ops.values() if op.op_type == "Allreduce"
                     and len(op.attrs.get("group") or ()) == 2]
    assert groups[0] and groups[2]
    slow = make_link(None, None, None)
    slow.alpha += 1e-3
    late = Predictor(calib_job, durations, slow, small=small)
    late.overhead, late.per_iteration = predictor.overhead, predictor.per_iteration
    added = late.predict(tppp.job, 4)[0] - tppp.iter_s
    assert added >= 0.99 * 1e-3 * (len(groups[0]) + len(groups[2]))
    # under a host limit only it fits: the best, its --set line and YAML
    limit = (tppp.need["host"] + min(hybrid.need["host"],
                                     cands["tensor 2-way"].need["host"])) // 2
    for c in (tppp, hybrid, cands["tensor 2-way"]):
        c.limits = {"host": (limit, "--host-memory")}
    choice = Choice(4, rank([hybrid, cands["tensor 2-way"], tppp]), ("tokens", 8), "", 0.0)
    assert choice.best is tppp
    text = format_choice(choice)
    row = next(line for line in text.splitlines() if ours[0] in line)
    assert "host " in row and " yes " in row
    assert text.splitlines()[-1] == f"best: {tppp.set_line()}"
    (tmp_path / "best.yaml").write_text(best_yaml(choice))
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["parallel"]["tensor_parallel"] == 2 and best["parallel"]["scheme"] == "pipeline"
    res = run_mpi_cli(4, "train", tmp_path / "best.yaml", "--iters", 2, "--out",
                      tmp_path / "run", timeout=600)
    assert res.returncode == 0, res.stderr
    assert "2 stages x 2-way tensor parallel" in res.stdout


def test_tensor_rows_are_listed_where_tensor_parallelism_splits_a_layer(tmp_path):
    """Tensor parallelism splits an MLP's fc pair, not only attention: this
    module's fc-only net (fc1 -> relu1 -> fc2, a pair ``find_splits`` finds)
    gets tensor 2-way and 4-way, sharded x tensor 2-way and pipeline x
    tensor 2-way on 4 ranks; a net of convolutions (nothing the scheme
    splits) gets no tensor row. Priced from a constructed calibration (no
    MPI for the prediction), tensor 2-way on 2 ranks is possible, and the
    YAML written for it as the choice trains on 2 ranks."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.choose import Choice, Predictor, _calibration_job, best_yaml, \
        candidates, evaluate, rank, small_batch
    from purine_mpi.tools.plan import MemoryLimits
    from purine_mpi.tools.scaling.link import make_link
    from purine_mpi.tools.scaling.trace_reader import Durations
    from tests.conftest import make_job
    path = _job(tmp_path)
    job = load_job(path, (), check_files=False)
    labels = [c.label for c in candidates(job, 4, Durations({}))]
    assert {"tensor 2-way", "tensor 4-way", "sharded stage 1 x tensor 2-way"} <= set(labels)
    assert any(label.startswith("pipeline") and label.endswith(" x tensor 2-way")
               for label in labels)
    conv = yaml.safe_load(NET.replace("SCHEME", "data"))
    conv["data"]["train"]["shape"] = [3, 8, 8]
    conv["net"] = [
        {"type": "conv", "name": "c1", "bottom": "data", "top": "c1", "num_output": 8,
         "kernel": 3},
        {"type": "relu", "name": "r1", "bottom": "c1", "top": "c1"},
        {"type": "conv", "name": "c2", "bottom": "c1", "top": "c2", "num_output": 10,
         "kernel": 6},
        {"type": "softmax_loss", "name": "loss", "bottom": ["c2", "label"], "top": "loss"}]
    conv_labels = [c.label for c in candidates(make_job(conv), 4, Durations({}))]
    assert conv_labels and not [label for label in conv_labels if "tensor" in label]

    calib_job = _calibration_job(path, ())
    small_job = _calibration_job(path, (), (f"data.train.batch_size={small_batch(2)}",))
    durations = _calibration_trace(calib_job, 1e-3)
    predictor = Predictor(calib_job, durations, make_link(None, None, None),
                          small=(_calibration_trace(small_job, 0.5e-3), small_job))
    tensor = next(c for c in candidates(job, 2, durations) if c.label == "tensor 2-way")
    evaluate(tensor, path, (), 2, MemoryLimits(host=1 << 40), predictor)
    assert tensor.error is None and tensor.iter_s > 0, tensor.error
    choice = Choice(2, rank([tensor]), ("samples", 16), "", 0.0)
    assert choice.best is tensor
    (tmp_path / "best.yaml").write_text(best_yaml(choice))
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["parallel"]["scheme"] == "tensor" and best["parallel"]["tensor_parallel"] == 2
    res = run_mpi_cli(2, "train", tmp_path / "best.yaml", "--iters", 2, "--out",
                      tmp_path / "run", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "2-way tensor" in res.stdout


def test_tensor_x_pipeline_stages_are_cut_by_the_split_ops_times():
    """Tensor parallelism within pipeline stages cuts its stages by the
    tensor shards' op times, not the whole net's traced ones. Two MLP fc
    pairs (m1a/m1b, m2a/m2b, split 2-way: each matrix product half its
    FLOPs) traced at 2 s each, then an unsplit head fc traced at 5 s (the
    other ops ~0): whole, 13 s, a layer's middle past 6.5 s starts stage 1,
    m2b's at 7 s (hybrid's cut: m1a .. r2 | m2b head); split, 1 s each and
    the head's 5 s, 9 s, m2b's middle at 3.5 s, the head's at 6.5 s past
    4.5 s (the cut: the pairs | head). Before, the tensor x pipeline rows
    took hybrid's cut: a stage of 6 s (m2b's 1, the head's 5) after one of 3."""
    from purine_mpi.tools.choose import Predictor, candidates
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.scaling.link import make_link
    from purine_mpi.tools.scaling.trace_reader import Durations
    from tests.conftest import make_job

    def fc(name, bottom, out):
        return {"type": "fc", "name": name, "bottom": bottom, "top": name, "num_output": out}
    relu = lambda name, bottom: {"type": "relu", "name": name, "bottom": bottom,  # noqa: E731
                                 "top": bottom}
    cfg = {"name": "headed", "seed": 1,
           "data": {"train": {"source": "synthetic", "shape": [64], "classes": 10,
                              "num_samples": 64, "batch_size": 8}},
           "net": [fc("m1a", "data", 256), relu("r1", "m1a"), fc("m1b", "m1a", 64),
                   fc("m2a", "m1b", 256), relu("r2", "m2a"), fc("m2b", "m2a", 64),
                   fc("head", "m2b", 10),
                   {"type": "softmax_loss", "name": "loss", "bottom": ["head", "label"],
                    "top": "loss"}],
           "solver": {"base_lr": 0.01, "max_iter": 2}, "parallel": {"scheme": "data"}}
    job = make_job(cfg)
    traced = {"m1a.fwd": 2.0, "m1b.fwd": 2.0, "m2a.fwd": 2.0, "m2b.fwd": 2.0, "head.fwd": 5.0}
    ops = {op: traced.get(op, 1e-9) for op in compose_for(job, 1, 0).ops}
    durations = Durations({0: ops}, {0: sum(ops.values())}, 5)
    predictor = Predictor(job, durations, make_link(None, None, None))
    cands = candidates(job, 4, durations, predictor)
    stages = lambda c: next(s for s in c.sets if s.startswith("parallel.stages="))  # noqa: E731
    whole = "parallel.stages={m1a: 0, r1: 0, m1b: 0, m2a: 0, r2: 0, m2b: 1, head: 1, loss: 1}"
    split = "parallel.stages={m1a: 0, r1: 0, m1b: 0, m2a: 0, r2: 0, m2b: 0, head: 1, loss: 1}"
    hybrid = [c for c in cands if c.label.startswith("hybrid 2 stages")]
    tppp = [c for c in cands if c.label.endswith("x tensor 2-way")
            and c.label.startswith("pipeline")]
    assert hybrid and {stages(c) for c in hybrid} == {whole}
    assert tppp and {stages(c) for c in tppp} == {split}, [stages(c) for c in tppp]


def test_a_setting_whose_ranks_would_stall_is_listed_not_possible(tmp_path):
    """A candidate whose simulated ranks wait for each other (the
    simulator's SimulationStalled: here two ranks that each receive before
    they send) is a row "not possible: its ranks would stall (...)", not a
    traceback (before: ``plan --choose`` on a tensor x pipeline net whose
    stage ends at a row-split fc stopped with a RuntimeError)."""
    from purine_mpi.tools.choose import Candidate, Choice, evaluate, format_choice
    from purine_mpi.tools.plan import MemoryLimits
    from purine_mpi.tools.scaling.simulate import RankGraph, SimOp, simulate

    def rank(r):
        other = 1 - r
        return RankGraph(r, {"recv": SimOp("recv", 1e-3, kind="recv", peer=other, tag=r),
                             "send": SimOp("send", 1e-3, ("recv",), kind="send", peer=other,
                                           tag=other)})

    class Stalls:
        def predict(self, job, n, built=None):
            return simulate([rank(0), rank(1)], 2)

    cand = evaluate(Candidate(("parallel.scheme=data",), "data"), _job(tmp_path), (), 2,
                    MemoryLimits(host=1 << 40), Stalls())
    assert cand.error.startswith("its ranks would stall (simulation of rank ")
    line = format_choice(Choice(2, [cand], ("images", 1), "", 0.0)).splitlines()[2]
    assert "data" in line and "not possible: its ranks would stall" in line


MICRO_NET = """name: micro_net
seed: 3
data:
  train: {source: synthetic, shape: [3, 32, 32], classes: 10, num_samples: 256, batch_size: 32}
net:
  - {type: conv, name: c1, bottom: data, top: c1, num_output: 16, kernel: 3, pad: 1}
  - {type: relu, name: r1, bottom: c1, top: c1}
  - {type: conv, name: c2, bottom: c1, top: c2, num_output: 16, kernel: 3, pad: 1}
  - {type: relu, name: r2, bottom: c2, top: c2}
  - {type: pool, name: p1, bottom: c2, top: p1, pool: max, kernel: 4, stride: 4}
  - {type: fc, name: fc, bottom: p1, top: fc, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc, label], top: loss}
solver: {type: sgd, base_lr: 0.01, momentum: 0.9, max_iter: 100, display: 1}
parallel: {scheme: data}
"""


def _write_calibration(path, cal, seconds=1e-3, add=1e-10, copy=1e-10, **trace):
    """A calibration file (``choose.read_calibration``'s format) of the job
    at ``path`` made of constructed traces (``_calibration_trace``: every
    op ``seconds`` at the job's batch, 0.3 of it at the small batch; or
    ``seconds`` a law of the graph and the op, ``_op_cost``, at both
    batches, with the traces' ``gap`` and ``after`` from ``trace``, and
    the file then holds the gaps and least times as a measured one does),
    the host's add rate ``add`` and copy rate ``copy``, so ``plan --choose``
    prices from known op times and measures nothing."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools import choose
    job = load_job(path, (), check_files=False)
    small_b = choose.small_batch(job.train_batch)
    big = _calibration_trace(choose._calibration_job(path, ()), seconds, **trace)
    small = _calibration_trace(choose._calibration_job(
        path, (), (f"data.train.batch_size={small_b}",)),
        seconds if callable(seconds) else 0.3 * seconds, **trace)

    def entry(d):  # a law's file holds the dispatcher's gap and the ops' least times too
        return {"per_rank": d.per_rank, "iter_seconds": d.iter_seconds,
                "iterations": d.iterations,
                **({"gaps": d.gaps, "fastest": d.fastest} if callable(seconds) else {})}
    cal.write_text(json.dumps({"format": choose.CALIBRATION_FORMAT,
                               "key": choose.calibration_key(job), "job": job.name,
                               **entry(big), "small": dict(entry(small), batch=small_b),
                               choose.ADD_RATE_KEY: add, choose.COPY_RATE_KEY: copy}))


def test_transfers_between_ranks_sharing_a_node_take_their_copies_from_compute(tmp_path):
    """Two ranks on one node (``plan``'s placement without a launcher's
    count: every rank on this node) and no ``--network`` file: each byte a
    rank sends costs it ``SHARED_MEMORY_COPIES`` copies at the host's copy
    rate (the calibration file's), taken from its compute. So ZeRO stage 3,
    whose second gather of every bucket its backward reads sends (N-1)/N of
    those bytes more than stage 2 does, is predicted that CPU slower than
    stage 2 beyond its time with one rank a node (``--ranks-per-node 1``, or a
    ``--network`` file, whose transfer CPU is measured: the figures
    before). Before, the transfers took no CPU at all: stage 3 ranked
    ahead of stage 2 (gpt_small on a 2-core node: first, 0.5 % ahead,
    measured 3 % behind)."""
    from purine_mpi.comm.ops import moved_bytes
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.scaling.link import SHARED_MEMORY_COPIES, Link, save_link
    copy = 2e-10
    job, cal = _job(tmp_path), tmp_path / "cal.json"
    _write_calibration(job, cal, _op_cost, gap=GAP, after=AFTER, add=ADD, copy=copy)
    link = tmp_path / "link.json"
    save_link(link, Link(1e-6, 12e9, ADD, "test"))  # the defaults' figures, measured

    def times(out):
        return {r["label"]: r["iter_s"] for r in out["candidates"] if r.get("iter_s")
                and r["label"].startswith("sharded stage") and "micro-batch" not in r["label"]
                and "recompute none" in r["label"]}
    runs = [_choose(job, cal, *extra) for extra in (
        (), ("--ranks-per-node", 1), ("--network", link))]
    shared, alone, measured = (times(out) for out, _ in runs)
    said = [res.stderr.count("ranks sharing a node: 2 a node; each byte a rank sends costs it "
                             f"{SHARED_MEMORY_COPIES} copies at the host's "
                             f"{SHARED_MEMORY_COPIES / (SHARED_MEMORY_COPIES * copy) / 1e9:.1f} "
                             "GB/s") for _, res in runs]
    assert said == [1, 0, 0], [res.stderr for _, res in runs]
    z2, z3 = "sharded stage 2, recompute none", "sharded stage 3, recompute none"
    assert {z2, z3} <= set(shared), shared

    def sent(stage):  # the bytes rank 0 sends an iteration: (N-1)/N of each buffer
        g = compose_for(load_job(job, ("parallel.scheme=sharded", f"parallel.shard={stage}"),
                                 check_files=False), 2, 0)
        return sum(moved_bytes(g, op) / 2 for op in g.ops.values()
                   if op.op_type in ("Allgather", "ReduceScatter"))
    # stage 3's second gather: every bucket a backward op reads (fc1's
    # weight has none: the data needs no gradient), float32
    extra = sent(3) - sent(2)
    assert extra == 4 * (2 * (1536 * 1536 + 1536) + 1536 * 10 + 10) / 2  # fc2, fc3, fc4
    # one rank a node, or the link's transfer CPU measured: as before
    assert measured == pytest.approx(alone, rel=1e-9)
    # each setting pays the copies of the bytes it sends, on its compute
    # lane: all of it where the lane would have run on, a little less where
    # it would have waited for a transfer (the debt fills the wait)
    for stage in (1, 2, 3):
        label, cpu = f"sharded stage {stage}, recompute none", \
            SHARED_MEMORY_COPIES * copy * sent(stage)
        assert 0.9 * cpu < shared[label] - alone[label] <= cpu * (1 + 1e-9), (label, cpu)
    # stage 3's extra gathers came out free (it ranked ahead of stage 2);
    # now their copies put it behind
    assert alone[z3] < alone[z2] < shared[z2] < shared[z3]


@pytest.mark.parametrize("bad", [float("inf"), 1e300, "fast", 0, -1e-10, float("nan")])
def test_a_calibration_files_copy_rate_that_is_not_one_is_timed_again(tmp_path, bad):
    """A ``copy_s_per_byte`` that no timing of a copy gives (infinite, huge,
    a string, 0, below 0, NaN: a file edited by hand) is timed again, said
    in one line, and the timed rate replaces it (``choose.host_copy_cost``).
    Before, an infinite or huge one was used as it stood, the others timed
    again without a word."""
    from purine_mpi.tools import choose
    job, cal = _job(tmp_path), tmp_path / "cal.json"
    _write_calibration(job, cal, _op_cost, gap=GAP, after=AFTER, add=ADD, copy=bad)
    lines = []
    rate = choose.host_copy_cost(str(cal), lines.append)
    assert lines == [f"calibration: {cal}: {choose.COPY_RATE_KEY} {bad!r} is not a host's "
                     f"copy rate (seconds per byte, above 0, at most "
                     f"{choose.MAX_HOST_S_PER_BYTE:g}): timed again"]
    assert choose.host_rate(rate) and json.loads(cal.read_text())[choose.COPY_RATE_KEY] == rate
    # the rate kept there is read on the next call: said no more
    assert choose.host_copy_cost(str(cal), lines.append) == rate and len(lines) == 1


@pytest.mark.parametrize("bad", [1e300, float("inf"), 0])
def test_a_calibration_files_add_rate_that_is_not_one_is_read_as_absent(tmp_path, bad):
    """An ``add_s_per_byte`` no timing of a sum gives is read as absent
    (``read_calibration``'s third figure None: ``calibrate`` times it and
    replaces it), the op times still read. Before, 1e300 was read as the
    host's add rate: every local add and untraced sum priced at it."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools import choose
    job, cal = _job(tmp_path), tmp_path / "cal.json"
    _write_calibration(job, cal, _op_cost, gap=GAP, after=AFTER, add=bad)
    j = load_job(job, (), check_files=False)
    found = choose.read_calibration(str(cal), choose.calibration_key(j),
                                    choose.small_batch(j.train_batch))
    assert found is not None and found[2] is None
    _write_calibration(job, cal, _op_cost, gap=GAP, after=AFTER, add=ADD)
    assert choose.read_calibration(str(cal), choose.calibration_key(j),
                                   choose.small_batch(j.train_batch))[2] == ADD


def test_plan_choose_with_a_huge_copy_rate_in_its_calibration_ranks_from_a_timed_one(tmp_path):
    """``plan --choose`` on a calibration file whose ``copy_s_per_byte`` is
    1e300: timed again, every setting priced in seconds. Before, every
    setting's transfers cost 10^290 s and the table ranked them at 0
    images/s, exit 0 (Infinity: every setting 'not possible')."""
    from purine_mpi.tools import choose
    job, cal = _job(tmp_path), tmp_path / "cal.json"
    _write_calibration(job, cal, _op_cost, gap=GAP, after=AFTER, add=ADD, copy=1e300)
    out, res = _choose(job, cal)
    assert res.returncode == 0, res.stderr
    assert f"{choose.COPY_RATE_KEY} 1e+300 is not a host's copy rate" in res.stderr
    ranked = [r for r in out["candidates"] if r.get("iter_s")]
    assert ranked and all(0 < r["iter_s"] < 1.0 for r in ranked), ranked[:2]


def test_a_calibration_file_that_cannot_keep_the_copy_rate_still_plans(tmp_path, monkeypatch):
    """A calibration file without the copy rate that cannot take it -- a
    file made read-only (chmod a-w), a folder where it cannot be replaced
    -- keeps what it held; the rate, timed, is used on the run and one line
    says it is not kept. Before, the read-only file was replaced all the
    same by a rename (which needs only the folder writable: its mode lost)
    and an unwritable folder ended ``plan --choose`` with 'cannot be
    written there ... give another --out' (exit 2) though every op time
    was in the file."""
    import errno
    import os
    from purine_mpi.tools import choose
    job, cal = _job(tmp_path), tmp_path / "cal.json"
    _write_calibration(job, cal, _op_cost, gap=GAP, after=AFTER, add=ADD)
    data = json.loads(cal.read_text())
    del data[choose.COPY_RATE_KEY]
    cal.write_text(json.dumps(data))
    before = cal.read_bytes()
    os.chmod(cal, 0o444)
    try:
        out, res = _choose(job, cal)
        assert res.returncode == 0, res.stderr
        assert cal.read_bytes() == before and os.stat(cal).st_mode & 0o777 == 0o444
        assert f"calibration: {cal}: the host's copy rate, timed, is used on this run but " \
            "not kept there (the file is read-only)" in res.stderr
        assert any(r.get("iter_s") for r in out["candidates"])
    finally:
        os.chmod(cal, 0o644)

    def refused(path, text):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path) + ".tmp")
    monkeypatch.setattr(choose, "write_text_replacing", refused)
    lines = []
    rate = choose.host_copy_cost(str(cal), lines.append)
    assert choose.host_rate(rate) and cal.read_bytes() == before
    assert lines == [f"calibration: {cal}: the host's copy rate, timed, is used on this run "
                     "but not kept there (Permission denied)"]


def test_choose_offers_micro_batches_where_only_they_fit(tmp_path):
    """Gradient accumulation among the candidates: data parallelism (and
    scheme sharded) at 2, 4, .. micro-batches dividing the per-rank batch,
    each with its memory plan and predicted time, tried where its setting
    does not fit at the job's count. The net's bytes are its activations
    (two 16-channel 32x32 convolutions at batch 32, weights of a few KiB):
    each count holds less than the one before, with recompute full or
    without (the recompute pass keeps about as much here), so where nothing
    fits every count dividing the batch is tried, up to 16 (before the
    micro-batches' readers shared their source, 4 held more than 2, each
    reader a synthetic pool of its own, and 8 and 16 were not tried). On one rank, under a
    --host-memory between the 2-micro-batch settings and the whole batch's,
    of the settings tried only those fit, and the best is 2 micro-batches without recompute by
    construction (the recompute pass adds the forward ops again, each
    priced as traced); 4, the check's count, is tried (no faster), larger
    counts not, and the table says so; the best's --set line and the --out
    YAML train."""
    path = tmp_path / "micro.yaml"
    path.write_text(MICRO_NET)
    cal = tmp_path / "cal.json"
    _write_calibration(path, cal)
    none_fits, res = _choose(path, cal, "--host-memory", "1MiB", np=1)
    assert "calibration: timing" not in res.stderr and none_fits["best"] is None
    rows = {r["label"]: r for r in none_fits["candidates"]}
    # no sharding, no stages, no tensor shards on one rank
    counts = ("", ", 2 micro-batches", ", 4 micro-batches", ", 8 micro-batches",
              ", 16 micro-batches")
    assert sorted(rows) == sorted(f"data, recompute {mode}{m}" for mode in ("none", "full")
                                  for m in counts)
    for label, row in rows.items():
        assert row["iter_s"] > 0 and not row["fits"]
        if "micro" in label:
            assert row["set"][-2:] == [
                f"parallel.micro_batches={label.split(', ')[-1].split()[0]}",
                "parallel.mode=sync"]
    need = {label: r["need_bytes"]["host"] for label, r in rows.items()}
    for mode in ("none", "full"):
        held = [need[f"data, recompute {mode}{m}"] for m in counts]
        assert all(b < a for a, b in zip(held, held[1:])), need
    two = max(need[f"data, recompute {mode}, 2 micro-batches"] for mode in ("none", "full"))
    # between the 2-micro-batch settings and the whole batch's: every count
    # fits, and those above 2 are not tried (by the model no faster)
    others = min(v for label, v in need.items() if "micro" not in label)
    limit = (two + others) // 2
    # the micro-batched time: per-micro-batch op times from the trace at
    # their work, each op's fixed cost paid per call: slower than the
    # whole batch's, faster than twice it
    plain = rows["data, recompute none"]["iter_s"]
    assert plain < rows["data, recompute none, 2 micro-batches"]["iter_s"] < 2 * plain
    assert rows["data, recompute none, 2 micro-batches"]["iter_s"] < \
        rows["data, recompute none, 4 micro-batches"]["iter_s"]
    tight, res = _choose(path, cal, "--host-memory", limit, "--out", tmp_path / "best.yaml",
                         np=1)
    assert res.returncode == 0, res.stderr
    fit = [r["label"] for r in tight["candidates"] if r.get("fits")]
    # 4 micro-batches fit too: the check's count above 2 (no faster)
    assert sorted(fit) == [f"data, recompute {mode}, {m} micro-batches"
                           for mode in ("full", "none") for m in (2, 4)]
    assert len(tight["candidates"]) == 6 and tight["swept"] == []
    assert tight["candidates"][0]["label"] == "data, recompute none, 2 micro-batches"
    assert tight["best"] == ["parallel.scheme=data", "recompute=none",
                             "parallel.micro_batches=2", "parallel.mode=sync"]
    for r in tight["candidates"]:  # the same figures as without a fitting one
        assert r["iter_s"] == rows[r["label"]]["iter_s"]
    text = run_cli_here("plan", path, "--np", 1, "--choose", "--calibration", cal,
                        "--host-memory", limit)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert "6 settings tried, 4 shown" in lines[0]
    table = [line for line in lines[2:] if re.match(r"\d+ ", line)]
    assert [line.split("  ")[1].strip() for line in table] == [
        "data, recompute none, 2 micro-batches", "data, recompute full, 2 micro-batches",
        "data, recompute none", "data, recompute full"], table
    assert " yes " in table[0] and "NO: host over" in table[2]
    assert any(line.startswith("(4 setting(s) at other micro-batch counts not tried: 4 as a "
                               "smaller count fits") for line in lines), lines
    # which counts were not tried, and why: above the 2 that fits, in each mode
    assert none_fits["not_tried"] == []
    assert sorted((r["variant_of"], r["micro_batches"], r["reason"])
                  for r in tight["not_tried"]) == [
        (f"data, recompute {mode}", m, "smaller_fits") for mode in ("full", "none")
        for m in (8, 16)]
    assert lines[-2] == ("best: --set parallel.scheme=data --set recompute=none "
                         "--set parallel.micro_batches=2 --set parallel.mode=sync")
    # the net has no Sum to price the micro-batches' gradient sums from:
    # said on the row and under the table, not priced as traced
    assert table[0].split()[-2].endswith("*") and not table[2].split()[-2].endswith("*")
    assert lines[-1].startswith("note: 6 op(s) of the best setting were not in the "
                                "calibration's trace")
    # the --set line and the YAML written train
    sets = [a for s in tight["best"] for a in ("--set", s)]
    res = run_mpi_cli(1, "train", path, *sets, "--iters", 2, "--host-memory", limit, "--out",
                      tmp_path / "run", timeout=300)
    assert res.returncode == 0, res.stderr
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["parallel"]["micro_batches"] == 2 and best["recompute"] == "none"
    res = run_mpi_cli(1, "train", tmp_path / "best.yaml", "--iters", 2, "--host-memory", limit,
                      "--out", tmp_path / "run_yaml", timeout=300)
    assert res.returncode == 0, res.stderr
    for run in ("run", "run_yaml"):
        cfg = yaml.safe_load((tmp_path / run / "config.yaml").read_text())
        assert cfg["parallel"]["micro_batches"] == 2


def test_the_prediction_reads_the_graphs_built_for_the_memory_plan(tmp_path):
    """``plan --choose`` predicts from the graphs it built for a setting's
    memory plan (``plan.predictable_graph``: the memory plans' control
    edges taken out again), not from a second composition: they are the
    graphs ``compose_for`` composes, op by op and blob by blob, for
    settings of each kind (micro-batches, recompute, ZeRO stages, stages,
    tensor shards), and the prediction from them is the prediction from
    composed graphs."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.choose import Predictor, _calibration_job
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.plan import offline_footprints, predictable_graph
    from purine_mpi.tools.scaling.link import make_link
    path = _job(tmp_path)
    calib_job = _calibration_job(path, ())
    predictor = Predictor(calib_job, _calibration_trace(calib_job, 1e-3),
                          make_link(None, None, None), add=1e-10)

    def content(graph):
        return ([(n, op.op_type, op.inputs, op.outputs, repr(op.attrs), op.location,
                  op.thread, op.accumulate, op.control_inputs) for n, op in graph.ops.items()],
                [(n, repr(b.__dict__)) for n, b in graph.blobs.items()])
    edges = 0
    for sets in (("parallel.micro_batches=2", "recompute=full"),
                 ("parallel.scheme=sharded", "parallel.shard=3", "parallel.micro_batches=2"),
                 ("parallel.scheme=pipeline", "parallel.stages=2", "parallel.micro_batches=2"),
                 ("parallel.scheme=tensor", "parallel.tensor_parallel=2")):
        job = load_job(path, sets, check_files=False)
        built = {}
        offline_footprints(job, 2, [0, 1], built=built)
        edges += sum(len(p.edges) for _, plans in built.values() for p in [plans.host])
        graphs = {r: predictable_graph(job, 2, *built[r]) for r in (0, 1)}
        for r, graph in graphs.items():
            assert content(graph) == content(compose_for(job, 2, r)), (sets, r)
        assert predictor.predict(job, 2, graphs) == predictor.predict(job, 2), sets
    assert edges > 0  # the memory plans did add edges, taken out again


def test_micro_batch_counts_are_tried_while_they_may_be_the_fastest_that_fits(tmp_path):
    """``variants_to_try`` over constructed needs (no graph built): the
    counts in ascending order, those below the job's first, up to the first
    that fits (whatever each holds against the one before: past a count
    that holds more, a larger one may hold less again, tests/
    test_choose_all.py). ``shown`` keeps one of each setting's counts: the
    first that fits in the ranking, else the one nearest to fitting."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.choose import Candidate, micro_batch_counts, micro_batched, shown, \
        variants_to_try
    job = load_job(_job(tmp_path), ("parallel.micro_batches=4",), check_files=False)
    assert micro_batch_counts(job) == [1, 2, 8, 16]  # batch 16, the job's own 4 left out

    def run(need_of, own=4, limit=100):
        plain = Candidate(("parallel.scheme=data", "recompute=none"), "data, recompute none")
        variants = micro_batched(plain, [m for m in (1, 2, 4, 8, 16) if m != own])
        tried = []

        def evaluate(c):
            m = c.micro or own
            c.need, c.limits, c.iter_s, c.samples = {"host": need_of[m]}, \
                {"host": (limit, "--host-memory")}, float(m), 16
            tried.append(m)
        evaluate(plain)
        tried.clear()
        done = variants_to_try(plain, variants, own, evaluate)
        assert [c.micro for c in done] == tried
        return tried, plain, done
    # neither the job's count nor those below fit: 8 does not, 16 fits
    assert run({1: 400, 2: 300, 4: 200, 8: 150, 16: 90})[0] == [1, 2, 8, 16]
    # 8 fits: 16, the check's count, is tried (no faster: it would stop there)
    assert run({1: 400, 2: 300, 4: 200, 8: 90, 16: 50})[0] == [1, 2, 8, 16]
    # 16 holds more than 8 (the weights' gradients), and does not fit either
    assert run({1: 400, 2: 300, 4: 200, 8: 150, 16: 160})[0] == [1, 2, 8, 16]
    # 8 holds more than 4, 16 less again and fits: tried (before: not tried)
    assert run({1: 400, 2: 300, 4: 200, 8: 210, 16: 100})[0] == [1, 2, 8, 16]
    # a smaller count fits: the smallest that fits (the fastest), and the
    # check's count above it (here the job's own 4, evaluated already)
    assert run({1: 120, 2: 80, 4: 60, 8: 50, 16: 40})[0] == [1, 2]
    # 2 holds more than 4 and does not fit, 1 fits: tried (before: not tried)
    assert run({1: 90, 2: 110, 4: 60, 8: 50, 16: 40})[0] == [1, 2]
    tried, plain, done = run({1: 60, 2: 50, 4: 40, 8: 30, 16: 20})
    assert tried == [1, 2]
    # the table: of the variants, the first that fits in the ranking
    from purine_mpi.tools.choose import rank
    ranked = rank([plain] + done)
    assert [c.label for c in shown(ranked)] == ["data, recompute none, 1 micro-batch",
                                                 "data, recompute none"]
    # none fits: the nearest to fitting
    tried, plain, done = run({1: 400, 2: 300, 4: 200, 8: 150, 16: 120})
    assert tried == [1, 2, 8, 16]
    assert [c.label for c in shown(rank([plain] + done))] == [
        "data, recompute none", "data, recompute none, 16 micro-batches"]
    # the job's own count fits: the check's count above it (evaluated, no
    # faster) is no row of its own (before: a '2 micro-batches' row beside
    # each setting that fit, 9 of 23 rows for tests/test_choose.py's net)
    tried, plain, done = run({1: 60, 2: 50, 4: 40, 8: 30, 16: 20}, own=1)
    assert tried == [2] and plain.fits
    assert [c.label for c in shown(rank([plain] + done))] == ["data, recompute none"]


def test_choose_json_says_which_counts_were_not_tried(tmp_path):
    """Each micro-batch count ``variants_to_try`` leaves out gets the reason
    of the stop (``NOT_TRIED``), for each rule: after a count that fits
    (below the job's count or above it), and above it after one not
    possible.
    ``--json``'s ``not_tried`` lists them (label, --set options, count, the
    setting they are counts of, reason and words) and the table's footer
    counts them by reason in one line. Before: no reason was kept
    (ImportError: NOT_TRIED), ``--json`` had no ``not_tried`` and the
    footer gave one sentence for every count."""
    from purine_mpi.tools.choose import NOT_TRIED, Candidate, Choice, choice_json, \
        format_choice, micro_batched, variants_to_try

    def run(need_of, own=4, limit=100, refused=()):
        plain = Candidate(("parallel.scheme=data", "recompute=none"), "data, recompute none")
        variants = micro_batched(plain, [m for m in (1, 2, 4, 8, 16) if m != own])

        def evaluate(c):
            m = c.micro or own
            if m in refused:
                c.error = "refused"
                return
            c.need, c.limits, c.iter_s, c.samples = {"host": need_of[m]}, \
                {"host": (limit, "--host-memory")}, float(m), 16
        evaluate(plain)
        done = variants_to_try(plain, variants, own, evaluate)
        left = {c.micro: c.not_tried for c in variants if c not in done}
        assert all(c.not_tried is None for c in done)
        return plain, done, left, variants
    # 8 fits: 16 is the check's count (tried: no faster); 1, 2 and 4 do not fit
    _, _, left, _ = run({1: 400, 2: 300, 4: 200, 8: 90, 16: 50})
    assert left == {}
    # 8 holds more than 4: 16 is tried all the same
    _, _, left, _ = run({1: 400, 2: 300, 4: 200, 8: 210, 16: 100})
    assert left == {}
    # 8 is not possible: 16 is not tried
    _, _, left, _ = run({1: 400, 2: 300, 4: 200, 8: 150, 16: 120}, refused=(8,))
    assert left == {16: "not_possible"}
    # 1 fits: 2 is the check's count (no faster), 8 and 16 are not tried
    _, _, left, _ = run({1: 60, 2: 50, 4: 40, 8: 30, 16: 20})
    assert left == {8: "smaller_fits", 16: "smaller_fits"}
    # 1 is not possible, 2 fits: 8 and 16 are not tried
    _, _, left, _ = run({1: 60, 2: 50, 4: 40, 8: 30, 16: 20}, refused=(1,))
    assert left == {8: "smaller_fits", 16: "smaller_fits"}
    # from 1 micro-batch, nothing fits and each count holds less: every count tried
    _, _, left, _ = run({1: 400, 2: 300, 4: 200, 8: 150, 16: 120}, own=1)
    assert left == {}
    plain, done, left, variants = run({1: 60, 2: 50, 4: 40, 8: 30, 16: 20})
    other, also, _, more = run({1: 400, 2: 300, 4: 200, 8: 150, 16: 120}, refused=(8,))
    skipped = [c for c in variants + more if c not in done + also]
    choice = Choice(2, [plain, other] + done + also, ("images", 1), "", 0.0,
                    untried=len(skipped), not_tried=skipped)
    out = choice_json(choice)
    assert [(r["micro_batches"], r["reason"]) for r in out["not_tried"]] == [
        (8, "smaller_fits"), (16, "smaller_fits"), (16, "not_possible")]
    for r in out["not_tried"]:
        assert set(r) == NOT_TRIED_KEYS
        assert r["variant_of"] == "data, recompute none" and r["why"] == NOT_TRIED[r["reason"]]
        assert r["set"][-1] == f"parallel.micro_batches={r['micro_batches']}"
        assert r["label"].startswith("data, recompute none, ")
    footer = [line for line in format_choice(choice).splitlines() if "not tried" in line]
    assert footer == [
        "(3 setting(s) at other micro-batch counts not tried: 2 as "
        f"{NOT_TRIED['smaller_fits']}; 1 as the count tried before it is "
        "not possible; --json: not_tried)"], footer


def test_the_check_evaluates_every_count_where_a_larger_one_is_faster():
    """``variants_to_try``'s check, over constructed figures (no graph
    built): where the count above the first that fits is predicted faster
    (the model's time need not rise with the count: smaller ops may overlap
    better), every count of the setting is evaluated, the best (16
    micro-batches here, each count faster than the one below) is among them
    as ``plan --choose-all`` finds it, and ``swept`` says why (table line,
    ``--json``); where it is no faster, the counts above it are left out.
    Before: 1 fit, so 2, 8 and 16 were left out and the best was the job's
    4 micro-batches ('assert [1] == [1, 2, 8, 16]')."""
    from purine_mpi.tools.choose import Candidate, Choice, choice_json, format_choice, \
        micro_batched, rank, variants_to_try

    def run(seconds, own=4):
        plain = Candidate(("parallel.scheme=data", "recompute=none"), "data, recompute none")
        variants = micro_batched(plain, [m for m in (1, 2, 4, 8, 16) if m != own])
        tried = []

        def evaluate(c):
            m = c.micro or own
            c.need, c.limits, c.iter_s, c.samples = {"host": 10}, \
                {"host": (100, "--host-memory")}, seconds[m], 16
            tried.append(m)
        evaluate(plain)
        tried.clear()
        done = variants_to_try(plain, variants, own, evaluate)
        got = list(tried)
        every = [plain] + variants
        for c in every:
            if c not in done and c is not plain:
                evaluate(c)  # --choose-all's figures
        return got, plain, done, rank(every)[0]
    falling = {1: 5.0, 2: 4.0, 4: 3.0, 8: 2.0, 16: 1.0}
    tried, plain, done, best = run(falling)
    assert tried == [1, 2, 8, 16]
    assert rank([plain] + done)[0] is best and best.micro == 16
    assert plain.swept.startswith("2 micro-batches predicted faster than 1")
    choice = Choice(1, rank([plain] + done), ("images", 1), "", 0.0, swept=[plain])
    assert f"(check: data, recompute none: {plain.swept})" in format_choice(choice)
    assert choice_json(choice)["swept"] == [{"label": "data, recompute none",
                                             "why": plain.swept}]
    # a rise at the check's count: the counts above it left out, none swept
    tried, plain, done, best = run({1: 1.0, 2: 2.0, 4: 3.0, 8: 4.0, 16: 5.0})
    assert tried == [1, 2] and plain.swept is None and best.micro == 1
    # the check's count is the job's own (evaluated already): faster, so swept
    tried, plain, done, best = run({1: 5.0, 2: 4.0, 4: 3.0, 8: 2.0, 16: 1.0}, own=2)
    assert tried == [1, 4, 8, 16] and plain.swept is not None and best.micro == 16


def test_the_check_passes_over_a_count_not_possible():
    """Where the count above the first that fits is not possible (refused),
    the check compares the next count: below the job's own count the walk
    goes on (here the job's 4, predicted faster than 1: every count
    evaluated, the best 16 among them); above it the counts left are not
    possible, not 'a smaller count fits, and the count above it is
    predicted no faster'. Before: the refused count ended the check, 8 and
    16 left out as no faster ('assert [1, 2] == [1, 2, 8, 16]'), and above
    the job's count 4, 8 and 16 were 'smaller_fits'."""
    from purine_mpi.tools.choose import Candidate, micro_batched, rank, variants_to_try

    def run(own, refused):
        plain = Candidate(("parallel.scheme=data", "recompute=none"), "data, recompute none")
        variants = micro_batched(plain, [m for m in (1, 2, 4, 8, 16) if m != own])
        tried = []

        def evaluate(c):
            m = c.micro or own
            tried.append(m)
            if m in refused:
                c.error = "refused"
                return
            c.need, c.limits, c.iter_s, c.samples = {"host": 10}, \
                {"host": (100, "--host-memory")}, 6.0 - m / 4, 16
        evaluate(plain)
        tried.clear()
        done = variants_to_try(plain, variants, own, evaluate)
        return tried, plain, done, {c.micro: c.not_tried for c in variants if c not in done}
    tried, plain, done, left = run(own=4, refused=(2,))
    assert tried == [1, 2, 8, 16] and left == {}
    assert plain.swept.startswith("4 micro-batches predicted faster than 1")
    assert rank([plain] + done)[0].micro == 16
    tried, plain, done, left = run(own=1, refused=(2,))
    assert tried == [2] and plain.swept is None
    assert left == {4: "not_possible", 8: "not_possible", 16: "not_possible"}


def test_choose_refuses_a_graph_config(tmp_path):
    """A complete ``graph:`` (``graph --format yaml``) is one composition
    already, with no batch of its own in the config (its data ops hold
    it): ``plan --choose`` on it stopped with a traceback (TypeError in
    job.global_batch: 'NoneType' and 'int', after 'timing ... at batch
    None'). Now exit 2 naming the key, before any calibration."""
    res = run_cli_here("graph", _job(tmp_path), "--format", "yaml")
    assert res.returncode == 0, res.stderr
    graph = tmp_path / "graph.yaml"
    graph.write_text(res.stdout)
    res = run_cli_here("plan", graph, "--np", 2, "--choose", "--calibration",
                       tmp_path / "cal.json")
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and "key 'graph'" in res.stderr, res.stderr
    assert "calibration: timing" not in res.stderr and not (tmp_path / "cal.json").exists()


def test_predict_refuses_a_trace_of_a_graph_config(tmp_path):
    """The same for ``predict TRACE_DIR --np N`` on a run of a complete
    ``graph:``: it stopped with the same TypeError (Scenario, batch None).
    Now exit 2 naming the run's config.yaml and the key."""
    res = run_cli_here("graph", _job(tmp_path), "--format", "yaml")
    assert res.returncode == 0, res.stderr
    graph = tmp_path / "graph.yaml"
    graph.write_text(res.stdout)
    run = tmp_path / "run"
    res = run_cli_args("train", graph, "--out", run, "--iters", 3, "--profile-iters", "1:3")
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli_here("predict", run, "--np", 2)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr
    assert f"{run / 'config.yaml'}: key 'graph'" in res.stderr, res.stderr


@pytest.mark.parametrize("damage", [
    lambda d: d.pop("per_rank"),
    lambda d: d.__setitem__("gaps", [1e-5]),
    lambda d: d.__setitem__("fastest", {"0": 3.0}),
    lambda d: d.__setitem__("iter_seconds", {"zero": 1.0}),
    lambda d: d.__setitem__("small", [4]),
    # edited by hand: a time below zero, not a number or infinite, no
    # iterations, a load factor of zero (each priced a setting silently wrong)
    lambda d: d["per_rank"]["0"].__setitem__(next(iter(d["per_rank"]["0"])), -1.0),
    lambda d: d["iter_seconds"].__setitem__("0", float("nan")),
    lambda d: d["small"]["per_rank"]["0"].__setitem__(next(iter(d["per_rank"]["0"])),
                                                      float("inf")),
    lambda d: d.__setitem__("iterations", 0),
    lambda d: d.__setitem__("iterations", True),
    lambda d: d.__setitem__("load", {"0": 0.0}),
    # an op, a gap or an iteration over an hour (MAX_CALIBRATION_S): 1e300
    # priced every setting at 10^300 s
    lambda d: d["per_rank"]["0"].__setitem__(next(iter(d["per_rank"]["0"])), 1e300),
    lambda d: d["small"]["per_rank"]["0"].__setitem__(next(iter(d["per_rank"]["0"])), 3601.0),
    lambda d: d.__setitem__("gaps", {"0": 1e300}),
    lambda d: d["iter_seconds"].__setitem__("0", 1e300),
])
def test_a_damaged_calibration_file_is_measured_again(tmp_path, damage):
    """A calibration file of this format and job whose entries are not what
    ``_measure`` writes (a key missing, ``gaps`` a list, a rank's
    ``fastest`` a number, a rank that is no integer) is unreadable, as
    broken JSON is: ``read_calibration`` says None (measured again), not a
    traceback. Before: a KeyError, AttributeError or ValueError out of
    ``read_calibration``."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools import choose
    path = _job(tmp_path)
    cal = tmp_path / "cal.json"
    _write_calibration(path, cal)
    job = load_job(path, (), check_files=False)
    small_b = choose.small_batch(job.train_batch)
    key = choose.calibration_key(job)
    assert choose.read_calibration(str(cal), key, small_b) is not None
    data = json.loads(cal.read_text())
    damage(data)
    cal.write_text(json.dumps(data))
    assert choose.read_calibration(str(cal), key, small_b) is None
    assert choose._unread(str(cal), key)   # said (calibrate logs it), not silently measured


def test_a_gpu_jobs_calibration_runs_without_cuda_graphs(tmp_path, digits_h5):
    """On a GPU a captured iteration's trace times each CUDA-graph replay,
    not its ops (predict says so and refuses such a trace): the calibration
    runs of a GPU job must trace its ops eagerly, or every setting would be
    priced from replay events that name no op."""
    from purine_mpi.tools.choose import CALIBRATION_SETS, _calibration_job
    from tests.conftest import small_net_config, write_config_file
    path = write_config_file(tmp_path, small_net_config(digits_h5))
    assert "cuda_graph=false" in CALIBRATION_SETS
    job = _calibration_job(path, ("device=0",))
    assert job.device == 0 and job.cuda_graph is False


def test_a_shared_nodes_transfer_cpu_is_the_copies_unless_measured(tmp_path):
    """``scaling/link.shared_node``: ranks sharing a node pay
    ``SHARED_MEMORY_COPIES`` copies at the host's rate per byte sent where
    the link's transfer CPU is the defaults' 0; a ``predict --calibrate``
    file's figure (0 too: a free core or RDMA) is a measurement and stays,
    as does every figure at one rank a node. A file written before the
    figure was kept (no ``cpu_s_per_byte``) measured none."""
    from purine_mpi.tools.scaling.link import SHARED_MEMORY_COPIES, Link, load_link, \
        make_link, save_link, shared_node
    default = make_link(None, None, None, gamma=1e-10)
    assert not default.cpu_measured and default.cpu == 0.0
    got = shared_node(default, 2, 3e-10)
    assert got.cpu == pytest.approx(SHARED_MEMORY_COPIES * 3e-10)
    assert (got.alpha, got.beta, got.gamma) == (default.alpha, default.beta, default.gamma)
    assert shared_node(default, 1, 3e-10) is default
    path = tmp_path / "link.json"
    save_link(path, Link(2e-6, 1e9, 1e-10, "test"))
    measured = load_link(path)
    assert measured.cpu_measured and shared_node(measured, 4, 3e-10) is measured
    data = json.loads(path.read_text())
    del data["cpu_s_per_byte"]
    path.write_text(json.dumps(data))
    old = load_link(path)
    assert not old.cpu_measured and shared_node(old, 2, 3e-10).cpu == pytest.approx(6e-10)


def test_a_shared_nodes_copies_are_paid_by_the_bytes_between_ranks_of_one_node():
    """N = 4 ranks, K a node in rank order, no ``--network`` file
    (``scaling/link.shared_node``): a collective's copies are paid on the
    share of the bytes a rank sends to a rank of its own node, by the
    partners of the algorithm the link prices (``same_node_share``): a
    ring sends all to the next rank, (N - nodes)/N of the ranks on their
    node; Rabenseifner's allreduce (``auto`` above SHORT_MSG) sends
    B/2^(i+1) to the rank 2^i away, (1 - 1/K)/(1 - 1/N) on the node; a
    reduce-scatter's recursive halving and an allgather's doubling 2^i/N
    of B, (K - 1)/(N - 1); recursive doubling (``tree``) a round to each.
    RDMA across nodes takes no CPU. Before, every byte sent paid the
    copies at any K >= 2 (K = 2 as K = 4)."""
    from purine_mpi.tools.scaling.link import SHARED_MEMORY_COPIES, Link, shared_node
    c, big, small = 3e-10, 1 << 20, 1024
    base = Link(1e-6, 12e9, 1e-10, "test")
    per_byte = SHARED_MEMORY_COPIES * c
    ranks = range(4)
    for k, ring, halving, halves, tree in ((4, 1.0, 1.0, 1.0, 1.0),
                                           (2, 1 / 2, (1 / 2) / (3 / 4), 1 / 3, 1 / 2),
                                           (1, 0.0, 0.0, 0.0, 0.0)):
        link = shared_node(base, k, c)
        allreduce = per_byte * 2 * 3 / 4 * big   # 2(N-1)/N of the bytes sent
        assert link.collective_cpu(ranks, big, "ring") == pytest.approx(allreduce * ring), k
        assert link.collective_cpu(ranks, big, "auto") == pytest.approx(allreduce * halving), k
        assert link.collective_cpu(ranks, big, "auto", halves=1) == \
            pytest.approx(allreduce / 2 * halves), k
        assert link.collective_cpu(ranks, big, "ring", halves=1) == \
            pytest.approx(allreduce / 2 * ring), k
        assert link.collective_cpu(ranks, big, "tree") == pytest.approx(allreduce * tree), k
        for alg in ("tree", "auto"):  # the halves: recursive halving / doubling at any size
            assert link.collective_cpu(ranks, small, alg, halves=1) == \
                pytest.approx(per_byte * 3 / 4 * small * halves), (k, alg)
        assert link.collective_cpu(ranks, small, "auto") == \
            pytest.approx(per_byte * 2 * 3 / 4 * small * tree), k
    # 3 ranks, 2 a node: (0, 1) on one node, 2 alone: a ring's 0 -> 1 of 3
    # sends; not a power of two otherwise: 2 of the 6 ordered pairs
    link = shared_node(base, 2, c)
    assert link.collective_cpu(range(3), big, "ring") == \
        pytest.approx(per_byte * 2 * 2 / 3 * big / 3)
    assert link.collective_cpu(range(3), big, "auto") == \
        pytest.approx(per_byte * 2 * 2 / 3 * big / 3)
    # a group's own ranks: (1, 3) on two nodes of 2 share none, (2, 3) one
    assert link.collective_cpu((1, 3), big, "ring") == 0.0
    assert link.collective_cpu((2, 3), big, "ring") == pytest.approx(per_byte * big)
    # a measured transfer CPU (a --network file) stays on every byte sent
    measured = Link(1e-6, 12e9, 1e-10, "test", cpu=5e-10, cpu_measured=True)
    assert shared_node(measured, 2, c).collective_cpu(ranks, big, "ring") == \
        pytest.approx(5e-10 * 2 * 3 / 4 * big)


def _comm_cpu(job, n, link, algorithm="auto"):
    """{(rank, op type): [(peer, bytes, cpu seconds)]} of every comm op of
    ``job``'s simulated ranks at ``n`` ranks on ``link``."""
    from purine_mpi.tools.scaling.model import Scenario, Template
    from tests.test_grad_dtype import _NoDurations
    scenario, got = Scenario(job, n), {}
    for rank in scenario.ranks:
        t = Template(job, scenario, rank)
        for name, op in t.graph.ops.items():
            if name in t.comm:
                sim = t._comm_op(op, (), _NoDurations(), link, algorithm, scenario)
                got.setdefault((rank, op.op_type), []).append((sim.peer, sim.nbytes, sim.cpu))
    return got


def test_the_predictor_charges_a_shared_nodes_copies_by_placement():
    """The model's comm ops (``Template._comm_op``) at 4 ranks, 2 a node:
    a data-parallel allreduce pays the copies on (1 - 1/2)/(1 - 1/4) = 2/3
    of its bytes (recursive halving and doubling), 1/2 on a ring; a
    pipeline's stage 0 -> 1 send (ranks 0, 1: one node) the copies of every
    byte, 1 -> 2 (across nodes) none; 4 a node: all of them. Before, each
    paid the copies of every byte at K = 2 as at 4."""
    from purine_mpi.tools.scaling.link import SHARED_MEMORY_COPIES, Link, shared_node
    from tests.mpi_scripts.common import mlp_config
    c = 3e-10
    base = Link(1e-6, 12e9, 1e-10, "test")
    per_byte = SHARED_MEMORY_COPIES * c
    dp = mlp_config(hidden=(64, 32))
    for k, alg, share in ((4, "auto", 1.0), (2, "auto", 2 / 3), (2, "ring", 1 / 2)):
        got = _comm_cpu(dp, 4, shared_node(base, k, c), alg)
        reduce = got[(0, "Allreduce")]
        assert any(b > 2048 for _, b, _ in reduce)
        for _, nbytes, cpu in reduce:
            want = share if alg == "ring" or nbytes > 2048 else 1 / 2 * (k == 2) + (k == 4)
            assert cpu == pytest.approx(per_byte * 2 * 3 / 4 * nbytes * want), (k, alg, nbytes)
    stages = {"fc1": 0, "relu1": 0, "fc2": 1, "relu2": 1, "out": 2, "loss": 3}
    pipe = mlp_config(hidden=(64, 32), parallel={"scheme": "pipeline", "stages": stages,
                                                 "transport": "two_sided"})
    for k in (2, 4):
        got = _comm_cpu(pipe, 4, shared_node(base, k, c))
        sends = [(rank, peer, nbytes, cpu) for (rank, kind), sims in got.items()
                 if kind == "Send" for peer, nbytes, cpu in sims]
        assert {(r, p) for r, p, _, _ in sends} >= {(0, 1), (1, 2), (2, 3)}
        for rank, peer, nbytes, cpu in sends:
            on_node = rank // k == peer // k
            assert cpu == pytest.approx(per_byte * nbytes * on_node), (k, rank, peer)
        assert any(cpu == 0 for *_, cpu in sends) == (k == 2)


def test_one_sided_transfers_on_a_node_pay_one_copy_each(monkeypatch):
    """``parallel.transport: one_sided`` with ranks sharing a node: a Put
    writes the target's window, a Get reads the owner's: one copy each, the
    origin's (no receiver copies out), none across nodes; none where the
    blob is the region itself (one node: computed into the consumer's
    region, read in place; comm/rma_ops.py's zero copy). Before, a Put
    paid a send's two copies, zero copy or not, and a Get (ZeRO stage 3's
    GetShards too) none. A measured transfer CPU (a --network file) prices
    a Put as a send, as before."""
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.scaling.link import Link, shared_node
    from tests.mpi_scripts.common import mlp_config

    def in_region(g, blob, region):  # the blob is the window's memory: a zero copy
        return any(g.blobs[b].attrs.get("window") == region
                   for b in (blob, g.storage_root(blob)))
    c = 3e-10
    base = Link(1e-6, 12e9, 1e-10, "test")
    measured = Link(1e-6, 12e9, 1e-10, "test", cpu=5e-10, cpu_measured=True)
    # a pipeline on one node (4 a node): the Puts that copy pay one copy
    stages = {"fc1": 0, "relu1": 0, "fc2": 1, "relu2": 1, "out": 2, "loss": 3}
    pipe = mlp_config(hidden=(64, 32), parallel={"scheme": "pipeline", "stages": stages,
                                                 "transport": "one_sided"})
    got = _comm_cpu(pipe, 4, shared_node(base, 4, c))
    graphs = {r: compose_for(pipe, 4, r) for r in range(4)}
    copied = 0
    for rank, g in graphs.items():
        puts = [op for op in g.ops.values() if op.op_type == "Put"]
        sims = got[(rank, "Put")]
        assert len(puts) == len(sims)
        for op, (peer, nbytes, cpu) in zip(puts, sims):
            zero = in_region(g, op.inputs[0], op.attrs["region"])
            copied += not zero
            assert cpu == pytest.approx(0.0 if zero else c * nbytes), (rank, op.name)
    assert copied >= 2  # stage 0's Puts of blobs it does not compute into the region
    assert all(cpu == 0.0 for sims in (v for (r, k), v in got.items() if k == "WaitWrite")
               for _, _, cpu in sims)
    # a parameter server on one node: the gradients computed into its
    # slots, its weights read in place: nothing copied
    ps = mlp_config(parallel={"mode": "sync_ps", "ps_ranks": 1, "transport": "one_sided"})
    got = _comm_cpu(ps, 3, shared_node(base, 3, c))
    assert got[(0, "Put")] and got[(0, "Get")]
    assert all(cpu == 0.0 for k in ("Put", "Get") for _, _, cpu in got[(0, k)])
    got = _comm_cpu(ps, 3, shared_node(measured, 3, c))
    assert all(cpu == pytest.approx(5e-10 * b) for _, b, cpu in got[(0, "Put")])
    # ZeRO stage 3 across nodes (RMA windows, 2 ranks a host): rank 0
    # gets owner 1's shard on its node (one copy), 2's and 3's by RDMA
    monkeypatch.setenv("PURINE_RANKS_PER_HOST", "2")
    z3 = mlp_config(hidden=(64, 32), parallel={"scheme": "sharded", "shard": 3,
                                               "transport": "one_sided"})
    g = compose_for(z3, 4, 0)
    gets = {op.name: sum(g.blobs[b].nbytes for b in op.outputs)
            for op in g.ops.values() if op.op_type == "GetShards"}
    assert gets
    got = _comm_cpu(z3, 4, shared_node(base, 2, c))
    assert sorted(cpu for _, _, cpu in got[(0, "GetShards")]) == \
        pytest.approx(sorted(c * nbytes / 4 for nbytes in gets.values()))
    # the rule (scaling/link.Link.one_sided_cpu)
    link = shared_node(base, 2, c)
    for kind in ("Put", "Get"):  # the rule: one copy on the node, none across
        assert link.one_sided_cpu(kind, 0, 1, 1000) == pytest.approx(c * 1000)
        assert link.one_sided_cpu(kind, 1, 2, 1000) == 0.0
    assert link.one_sided_cpu("Publish", 2, 2, 1000) == pytest.approx(c * 1000)
    assert measured.one_sided_cpu("Put", 0, 1, 1000) == pytest.approx(5e-10 * 1000)
    assert measured.one_sided_cpu("Get", 0, 1, 1000) == 0.0


def test_a_calibrations_op_time_over_an_hour_is_said_and_measured_again(tmp_path):
    """An op time of 1e300 (a file edited by hand) is no measurement:
    ``read_calibration`` reads nothing, and ``calibrate`` says why in the
    one line of the other damaged files. Before, it was read (only the
    host rates had an upper bound) and priced every setting at 10^300 s."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools import choose
    path, cal = _job(tmp_path), tmp_path / "cal.json"
    _write_calibration(path, cal)
    job = load_job(path, (), check_files=False)
    key, small_b = choose.calibration_key(job), choose.small_batch(job.train_batch)
    data = json.loads(cal.read_text())
    op = next(iter(data["per_rank"]["0"]))
    data["per_rank"]["0"][op] = 3600.0  # an hour (MAX_CALIBRATION_S): still read
    cal.write_text(json.dumps(data))
    assert choose.read_calibration(str(cal), key, small_b) is not None
    data["per_rank"]["0"][op] = 1e300
    cal.write_text(json.dumps(data))
    assert choose.read_calibration(str(cal), key, small_b) is None
    assert choose._unread(str(cal), key) == (
        "holds entries that are not a measurement's (a time below zero, NaN, over 3600 s, "
        "a key missing)")
