"""``plan --choose`` and parameter servers (``parallel.mode: sync_ps``).

Every synchronous candidate (data, sharded, pipeline, tensor) says
``parallel.mode=sync``: a job of mode sync_ps does not lend them its mode.
Found: they set no mode, so under a job of ``mode: sync_ps`` the
candidate "data, recompute none" loaded as sync_ps (on the code before:
``AssertionError`` on its job's mode, ``'sync_ps' != 'sync'``), priced
and written out as parameter servers under a data-parallel label.

The parameter-server candidates: mode sync_ps with K = 1 .. N/2 servers
(``tools/choose.server_candidates``), priced and listed but not ranked
with the others: their model is not validated against measurement
(docs/scaling.md, "Parameter servers": measured 2-rank runs took 1.5x to
4.1x their predictions on digits_lenet, 0.57x on cifar10_quick_wide), so
they come after every ranked setting, marked, and are never the best (a
line under the table says why, the line docs/scaling.md quotes). A rule of the parameter servers (clipping with more than
one server) lists the setting as not possible with its reason; mode async
is never offered. Where they are predicted the fastest (a constructed
calibration of a host whose adds are slow: a 2-rank allreduce's reduction
costs more than the worker's push and pull), they are still not chosen,
by ``plan --choose`` nor by ``parallel.scheme: auto`` (on the code before
the note: the auto line named 1 server and 1 worker)."""
import pytest

from purine_mpi.tools.choose import PS_NOT_VALIDATED, choice_json, choose, format_choice
from purine_mpi.tools.plan import MemoryLimits

NET = """name: choose_ps
seed: 3
data:
  train: {source: synthetic, shape: [1, 8, 8], classes: 10, num_samples: 256, batch_size: 16}
net:
  - {type: fc, name: fc1, bottom: data, top: fc1, num_output: 256}
  - {type: relu, name: relu1, bottom: fc1, top: fc1}
  - {type: fc, name: fc2, bottom: fc1, top: fc2, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc2, label], top: loss}
solver: {type: sgd, base_lr: 0.01, momentum: 0.9, max_iter: 100, display: 1CLIP}
parallel: {scheme: data, mode: sync_ps, ps_ranks: 1}
"""


@pytest.fixture(scope="module")
def cal(tmp_path_factory):
    """The folder of the jobs and their calibrations (the clipping job has
    ops the other has not: a calibration file each)."""
    return tmp_path_factory.mktemp("choose_ps")


def _choice(folder, n, clip=False):
    path = folder / ("clip.yaml" if clip else "job.yaml")
    path.write_text(NET.replace("CLIP", ", clip_gradients: 5.0" if clip else ""))
    calibration = folder / ("clip_cal.json" if clip else "cal.json")
    return choose(str(path), (), n, MemoryLimits(check=False), calibration=str(calibration))


def test_synchronous_candidates_do_not_inherit_a_sync_ps_jobs_mode(cal):
    choice = _choice(cal, 2)
    evaluated = [c for c in choice.ranked if c.error is None]
    servers = [c for c in evaluated if "parallel.mode=sync_ps" in c.sets]
    others = [c for c in evaluated if c not in servers]
    assert others and servers
    for c in others:
        assert c.job.parallel.mode == "sync", (c.label, c.job.parallel.mode)
        assert "parallel.mode=sync" in c.sets
    # 2 ranks: one server, one worker (global batch 16: one worker's)
    assert [c.label for c in servers if c.variant_of is None] == \
        ["parameter servers: 1 server, 1 worker"]
    for c in servers:
        assert c.job.parallel.mode == "sync_ps" and c.job.parallel.ps_ranks == 1
        assert c.samples == 16
    data = next(c for c in others if c.label == "data, recompute none")
    assert data.samples == 32  # two replicas
    # the others ranked by time per sample (tools/choose.rank); the
    # parameter servers listed after every one of them, none ranked
    keys = [c.iter_s / c.samples for c in others if c.fits]
    assert keys == sorted(keys)
    assert evaluated[len(others):] == servers
    assert all(c.unranked == PS_NOT_VALIDATED for c in servers)
    assert all(c.unranked is None for c in others)
    assert not any("async" in s for c in choice.ranked for s in c.sets)


def test_more_servers_are_offered_up_to_half_the_ranks_where_the_rules_allow(cal):
    """4 ranks: 1 and 2 servers; with clipping by the global norm 2
    servers are not possible (job/config.py: it needs every gradient in one
    place), named as such, while 1 server is."""
    choice = _choice(cal, 4, clip=True)
    plain = {c.label: c for c in choice.ranked if c.variant_of is None
             and "parallel.mode=sync_ps" in c.sets}
    assert sorted(plain) == ["parameter servers: 1 server, 3 workers",
                             "parameter servers: 2 servers, 2 workers"]
    one, two = plain["parameter servers: 1 server, 3 workers"], \
        plain["parameter servers: 2 servers, 2 workers"]
    assert one.error is None and one.samples == 3 * 16
    assert two.error is not None and "clip_gradients" in two.error, two.error


#: a net one fully connected layer wide (a 2-stage pipeline cuts it fc1 |
#: loss) whose weight gradient (256 KiB) dominates what an iteration moves
WIDE = """name: ps_wins
seed: 3
data:
  train: {source: synthetic, shape: [1, 8, 8], classes: 10, num_samples: 256, batch_size: 16}
net:
  - {type: fc, name: fc1, bottom: data, top: fc1, num_output: 1024}
  - {type: softmax_loss, name: loss, bottom: [fc1, label], top: loss}
solver: {type: sgd, base_lr: 0.01, momentum: 0.9, max_iter: 100, display: 1}
parallel: {scheme: SCHEME}
"""


def _slow_adds(path, cal):
    """A constructed calibration of the job at ``path`` (every op 1 ms:
    tests/test_choose._write_calibration) on a host whose adds run at
    1 µs a byte: an allreduce's reduction (B/2 adds on 2 ranks) costs
    0.13 s, while one worker and one server add nothing (W - 1 = 0)."""
    import json

    from purine_mpi.tools import choose as choose_mod
    from tests.test_choose import _write_calibration
    _write_calibration(path, cal)
    data = json.loads(cal.read_text())
    data[choose_mod.ADD_RATE_KEY] = 1e-6
    cal.write_text(json.dumps(data))


def test_parameter_servers_predicted_fastest_are_listed_not_chosen(tmp_path):
    """The slow-adds calibration prices 1 server + 1 worker faster per
    sample than any other setting; it is still not the best (the fastest
    ranked one is), listed after the ranked ones with "-" for its rank and
    its s/iter marked "?", the note under the table; --json says
    ``ranked: false`` with the note."""
    path, cal = tmp_path / "job.yaml", tmp_path / "cal.json"
    path.write_text(WIDE.replace("SCHEME", "data"))
    _slow_adds(path, cal)
    choice = choose(str(path), (), 2, MemoryLimits(check=False), calibration=str(cal))
    ps = next(c for c in choice.ranked if c.label == "parameter servers: 1 server, 1 worker")
    fit = [c for c in choice.ranked if c.error is None and c.fits]
    # predicted the fastest per sample of every setting that fits ...
    assert ps.iter_s / ps.samples < min(c.iter_s / c.samples for c in fit if c is not ps)
    # ... and not chosen: the best is the fastest of the others
    best = choice.best
    assert best is not None and "parallel.mode=sync_ps" not in best.sets, best.label
    ranked = [c for c in fit if c.unranked is None]
    assert best is ranked[0]
    assert best.iter_s / best.samples == min(c.iter_s / c.samples for c in ranked)
    assert "parameter servers" not in choice.why()
    text = format_choice(choice)
    row = next(line for line in text.splitlines() if "parameter servers: 1 server" in line)
    assert row.startswith("- ") and f"{ps.iter_s:.4g}?" in row, row
    note = f"? not ranked, never chosen by parallel.scheme auto: {PS_NOT_VALIDATED}"
    assert note in text.splitlines()  # why, in one line of its own, once
    assert sum(line.startswith("? ") for line in text.splitlines()) == 1
    # the docs quote the same line (docs/scaling.md, "Choosing a plan")
    import os
    import re
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "scaling.md")).read()
    assert note in re.sub(r"\s+", " ", docs), "docs/scaling.md does not quote the note"
    assert "best: " in text and "sync_ps" not in text.split("best: ")[1]
    rows = {r["label"]: r for r in choice_json(choice)["candidates"]}
    assert rows[ps.label]["ranked"] is False and rows[ps.label]["note"] == PS_NOT_VALIDATED
    assert rows[best.label]["ranked"] is True and "note" not in rows[best.label]


@pytest.mark.mpi
def test_scheme_auto_never_chooses_parameter_servers(tmp_path):
    """``parallel.scheme: auto`` on 2 ranks, the run folder's calibration
    the slow-adds one above (1 server + 1 worker predicted the fastest):
    rank 0 chooses a ranked setting, not the parameter servers (their
    model is not validated), every rank loads it, and the run trains
    (the loss logged, the run's config.yaml the chosen setting, mode sync)."""
    import json

    import yaml

    from tests.conftest import run_mpi_cli
    path, run = tmp_path / "auto.yaml", tmp_path / "run"
    path.write_text(WIDE.replace("SCHEME", "auto"))
    run.mkdir()
    _slow_adds(path, run / "calibration.json")
    res = run_mpi_cli(2, "train", path, "--iters", 3, "--out", run, timeout=600)
    assert res.returncode == 0, res.stderr
    chosen = [line for line in res.stdout.splitlines() if line.startswith("parallel.scheme auto:")]
    assert len(chosen) == 1 and "parameter servers" not in chosen[0], res.stdout
    assert "calibration: timing" not in res.stdout + res.stderr  # the file's, not measured
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["parallel"]["scheme"] != "auto" and cfg["parallel"]["mode"] == "sync"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("phase") == "train"]
    assert [r["iter"] for r in train][-1] == 3 and all(r["loss"] > 0 for r in train)


@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_scheme_auto_refuses_a_mode_it_would_not_keep(tmp_path, mode):
    """``parallel.scheme: auto`` with ``mode: sync_ps`` or ``async``: exit 2
    naming parallel.mode. Auto's choice is a synchronous setting, which says
    ``parallel.mode=sync`` (``choose.SYNC_MODE``): on the code before, the
    job loaded and auto would have replaced the mode without a word (a
    parameter-server or async run trained as mode sync)."""
    from tests.conftest import run_cli_here
    path = tmp_path / "auto.yaml"
    path.write_text(NET.replace("CLIP", "").replace(
        "{scheme: data, mode: sync_ps, ps_ranks: 1}", f"{{scheme: auto, mode: {mode}}}"))
    res = run_cli_here("plan", path, "--np", 2)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "parallel.mode" in res.stderr and "scheme auto" in res.stderr, res.stderr
    assert f"mode '{mode}'" in res.stderr or f"mode {mode}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    path.write_text(NET.replace("CLIP", "").replace(
        "{scheme: data, mode: sync_ps, ps_ranks: 1}", "{scheme: auto, mode: sync}"))
    ok = run_cli_here("plan", path, "--np", 2)
    assert "parallel.mode" not in ok.stderr, ok.stderr


def _choose_vs_real(monkeypatch, name):
    """benchmarks/choose_vs_real.py loaded as the module ``name``, its
    ``import sharded`` (benchmarks/sharded.py) put in sys.modules for the
    test only."""
    import importlib.util
    import os
    import sys
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks")

    def load(name, file):
        spec = importlib.util.spec_from_file_location(name, os.path.join(here, file))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    monkeypatch.setitem(sys.modules, "sharded", load("sharded", "sharded.py"))
    return load(name, "choose_vs_real.py")


def test_choose_vs_real_measures_the_ranked_settings_only(monkeypatch, tmp_path):
    """benchmarks/choose_vs_real.py runs and ranks ``plan --choose --json``'s
    settings that fit: the ranked ones only. On the code before it took the
    unranked parameter servers too (``"ranked": false``, listed after the
    ranked ones whatever their prediction): numbered as predicted ranks
    after them, they entered its Spearman correlation and its fastest
    measured setting."""
    import json
    import subprocess
    mod = _choose_vs_real(monkeypatch, "choose_vs_real_t")
    rows = [{"label": "data", "set": ["parallel.scheme=data"], "fits": True, "ranked": True},
            {"label": "big", "set": ["parallel.scheme=data"], "fits": False, "ranked": True},
            {"label": "ps", "set": ["parallel.mode=sync_ps"], "fits": True, "ranked": False,
             "note": PS_NOT_VALIDATED},
            {"label": "refused", "set": ["parallel.scheme=tensor"], "error": "no"}]
    out = json.dumps({"candidates": rows, "unit": "images", "best": rows[0]["set"]})
    monkeypatch.setattr(mod.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, out, ""))
    got, unit, unranked = mod.ranked("job.yaml", [], 2, str(tmp_path))
    assert [c["label"] for c in got] == ["data"] and unit == "images"
    # --with-ps measures the unranked ones apart (not_ranked), out of the ranking
    assert [c["label"] for c in unranked] == ["ps"]


def test_choose_vs_real_with_ps_measures_them_out_of_the_ranking(monkeypatch, tmp_path):
    """``--with-ps``: the unranked parameter servers run in the same rounds
    and come under ``not_ranked`` with their predicted and measured
    figures; measured the fastest, they still are neither the fastest
    measured setting nor in the rank correlation."""
    from types import SimpleNamespace
    mod = _choose_vs_real(monkeypatch, "choose_vs_real_ps")

    def row(label, iter_s, ranked=True):
        return {"label": label, "set": [f"x={label}"], "iter_s": iter_s,
                "samples_per_s": 32 / iter_s, "fits": True, "ranked": ranked}
    cands = [row("a", 0.1), row("b", 0.2)]
    monkeypatch.setattr(mod, "ranked", lambda *a: (cands, "images", [row("ps", 0.05, False)]))
    monkeypatch.setattr(mod.sharded, "base_sets", lambda *a: [])
    measured = {"x=a": 100.0, "x=b": 200.0, "x=ps": 50.0}  # ms/iter; ps the fastest
    monkeypatch.setattr(mod.sharded, "bench_once", lambda config, sets, *a: {
        "images_per_s": 32e3 / measured[sets[-1]], "iter_ms_median": measured[sets[-1]]})
    args = SimpleNamespace(top=0, with_ps=True, rounds=2, ranks=2, iters=1, warmup=0, set=[])
    got = mod.config_figures(str(tmp_path / "job.yaml"), args, str(tmp_path))
    assert [r["label"] for r in got["settings"]] == ["a", "b"]
    assert got["fastest_measured"] == "a" and got["spearman"] == 1.0
    (ps,) = got["not_ranked"]
    assert ps["label"] == "ps" and ps["measured_iter_s"] == 0.05
    assert ps["predicted_over_measured"] == 1.0 and len(ps["measured_samples_per_s_rounds"]) == 2
    args.with_ps = False
    assert mod.config_figures(str(tmp_path / "job.yaml"), args, str(tmp_path))["not_ranked"] == []


def test_choose_vs_real_link_options_reach_plan(monkeypatch, tmp_path):
    """benchmarks/choose_vs_real.py's ``--network`` / ``--calibrate-link``:
    plan gets ``--network FILE`` (and ``--ranks-per-node K``); ``--compare``
    adds plan's default (no ``--network``) and the file less its ``node``;
    without either, plan gets no link file, as before; the options that
    need a link file are refused without one (exit 2)."""
    import json
    import subprocess
    import pytest
    mod = _choose_vs_real(monkeypatch, "choose_vs_real_link")
    link = tmp_path / "l.json"
    link.write_text(json.dumps({"alpha_s": 3e-6, "beta_bytes_per_s": 1e10,
                                "node": {"ranks_per_node": 2}}))
    calls = []
    rows = [{"label": "data", "set": ["parallel.scheme=data"], "fits": True}]
    out = json.dumps({"candidates": rows, "unit": "images"})

    def fake_run(cmd, **k):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, out, "")
    monkeypatch.setattr(mod.subprocess, "run", fake_run)

    def args(*argv):
        ns = []
        monkeypatch.setattr(mod, "config_figures", lambda c, a, f: ns.append(a) or {})
        mod.main(["--configs", "job.yaml", *argv])
        return ns[0]
    a = args()
    plans, got = mod.links("job.yaml", a, str(tmp_path))
    assert plans == {"default": None} and got is None
    mod.ranked("job.yaml", [], 2, str(tmp_path), plans["default"])
    assert "--network" not in calls[-1]
    a = args("--network", str(link), "--ranks-per-node", "2", "--compare")
    plans, got = mod.links("job.yaml", a, str(tmp_path))
    assert list(plans) == ["link", "default", "link_without_node"] and got["node"]
    assert plans["link"] == (str(link), 2) and plans["default"] is None
    bare = json.loads(open(plans["link_without_node"][0]).read())
    assert "node" not in bare and bare["alpha_s"] == 3e-6
    mod.ranked("job.yaml", [], 2, str(tmp_path), plans["link"])
    i = calls[-1].index("--network")
    assert calls[-1][i + 1:i + 4] == [str(link), "--ranks-per-node", "2"]
    # --calibrate-link: predict --calibrate on RANKS ranks, K = RANKS
    ran = []

    def fake_calibrate(ranks, argv, what):
        ran.append((ranks, argv))
        open(argv[-1], "w").write(link.read_text())
    monkeypatch.setattr(mod.sharded, "run", fake_calibrate)
    a = args("--calibrate-link", "--ranks", "3")
    plans, _ = mod.links("job.yaml", a, str(tmp_path))
    assert ran == [(3, ["predict", "--calibrate", plans["link"][0]])]
    assert list(plans) == ["link"] and plans["link"][1] == 3
    for bad in (["--compare"], ["--ranks-per-node", "2"],
                ["--calibrate-link", "--network", str(link)],
                ["--calibrate-link", "--ranks-per-node", "2"],
                ["--network", str(tmp_path / "absent.json")]):
        with pytest.raises(SystemExit) as e:
            args(*bad)
        assert e.value.code == 2, bad


def test_choose_vs_real_baseline_root_runs_the_other_checkouts_plan(monkeypatch, tmp_path):
    """``--baseline-root CHECKOUT``: the plan (and the calibration run it
    starts, ``python -m purine_mpi`` from the same working directory) is
    that checkout's code. The plan runs in this checkout's folder, which
    ``python -m`` puts before PYTHONPATH on the module path: on the code
    before, the "baseline" was this checkout's plan (here: it failed on the
    missing job, never reaching the other checkout)."""
    import json
    import os
    mod = _choose_vs_real(monkeypatch, "choose_vs_real_base")
    root = tmp_path / "other"
    (root / "purine_mpi").mkdir(parents=True)
    (root / "purine_mpi" / "__init__.py").write_text("")
    # the other checkout's plan: one candidate named after the code that ran
    # it and the code a child it starts from the same folder imports
    (root / "purine_mpi" / "__main__.py").write_text(
        "import json, os, subprocess, sys\n"
        "import purine_mpi\n"
        "child = subprocess.run([sys.executable, '-c', 'import purine_mpi; "
        "print(purine_mpi.__file__)'], capture_output=True, text=True).stdout.strip()\n"
        "label = os.path.dirname(os.path.dirname(purine_mpi.__file__)) + '|' + "
        "os.path.dirname(os.path.dirname(child))\n"
        "print(json.dumps({'candidates': [{'label': label, 'set': [], 'fits': True}], "
        "'unit': 'images'}))\n")
    got, unit, _ = mod.ranked("job.yaml", [], 2, str(tmp_path), None, str(root))
    assert [c["label"] for c in got] == [f"{root}|{root}"]
    assert os.getcwd() != str(root)
