"""benchmarks/learn_gpu.py (the ``learn`` stage of gpu_session.sh) without a
GPU: its verdicts on curves made up to cross or not, the unigram entropies
against a plain-Python count, the corpus it picks, a run stopped at its cap,
and the whole flow on the CPU (gpt_tiny, fp32 against fp32, a few
iterations)."""
import collections
import json
import math
import pathlib
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from tests.conftest import REPO, cli_env

sys.path.insert(0, str(pathlib.Path(REPO) / "benchmarks"))
import learn_gpu  # noqa: E402


def _curve(points):
    return [{"iter": i, "seconds": s, "loop_s": s, "loss": loss} for i, s, loss in points]


def test_below_entropy_verdicts():
    v = learn_gpu.crossing
    # crosses 5.0 at iteration 100, 130 s in: PASS, that row named
    crossed = _curve([(0, 20, 10.8), (50, 80, 6.0), (100, 130, 4.9), (150, 180, 4.5)])
    res = v(crossed, 5.0, 200.0)
    assert (res["verdict"], res["iter"], res["seconds"], res["loss"]) == ("PASS", 100, 130, 4.9)
    # the same crossing but 700 s in: later than the 600 s target
    late = _curve([(0, 20, 10.8), (100, 700, 4.9)])
    assert v(late, 5.0, 720.0)["verdict"] == "FAIL"
    # never below: FAIL where the run lasted the target, INCOMPLETE where it was shorter
    flat = _curve([(0, 20, 10.8), (50, 300, 6.0), (100, 610, 5.2)])
    res = v(flat, 5.0, 620.0)
    assert res["verdict"] == "FAIL" and "never below 5.0000" in res["why"], res
    assert "the lowest 5.2000 by iteration 100" in res["why"]
    res = v(flat[:2], 5.0, 310.0)
    assert res["verdict"] == "INCOMPLETE" and "shorter than 600 s" in res["why"], res
    # equal to the threshold is not below it
    assert v(_curve([(0, 1, 5.0)]), 5.0, 700.0)["verdict"] == "FAIL"
    # a non-finite loss before any crossing fails, whatever comes after
    res = v(_curve([(0, 1, 10.8), (50, 40, None), (100, 80, 1.0)]), 5.0, 100.0)
    assert res["verdict"] == "FAIL" and "not finite at iteration 50" in res["why"]
    assert v([], 5.0, 0.0)["verdict"] == "INCOMPLETE"


def test_gap_verdicts_at_the_last_matched_iteration():
    first = {"curve": _curve([(0, 1, 10.8), (50, 5, 6.00), (100, 9, 5.00), (150, 13, 4.50)]),
             "wall_s": 15}
    second = {"curve": _curve([(0, 2, 10.8), (50, 15, 6.10), (100, 30, 4.96)]), "wall_s": 35}
    res = learn_gpu.verdicts(5.5, first, second, val_entropy=4.8)
    gap = res["gap"]
    # iteration 150 is the first run's alone: compared at 100 (5.00 - 4.96), not 150;
    # the larger gap at 50 (0.10) is listed, not judged
    assert gap["verdict"] == "PASS" and gap["iter"] == 100, gap
    assert gap["gap"] == pytest.approx(0.04) and gap["max_abs_gap"] == pytest.approx(0.10)
    assert [m[0] for m in gap["matched"]] == [0, 50, 100]
    assert res["below_entropy"]["iter"] == 100 and res["below_entropy"]["entropy"] == 5.5
    assert (res["below_val_entropy"]["iter"], res["below_val_entropy"]["entropy"]) == (150, 4.8)
    second["curve"][2]["loss"] = 4.93   # 5.00 - 4.93 = 0.07 > 0.05
    gap = learn_gpu.verdicts(5.5, first, second)["gap"]
    assert gap["verdict"] == "FAIL" and gap["gap"] == pytest.approx(0.07), gap
    second["curve"][2]["loss"] = 5.06   # the sign does not matter
    assert learn_gpu.verdicts(5.5, first, second)["gap"]["verdict"] == "FAIL"
    # only iteration 0 in common: nothing measured
    gap = learn_gpu.verdicts(5.5, first, {"curve": second["curve"][:1], "wall_s": 3})["gap"]
    assert gap["verdict"] == "INCOMPLETE" and "above 0" in gap["why"]
    second["curve"][2]["loss"] = None
    assert learn_gpu.verdicts(5.5, first, second)["gap"]["verdict"] == "FAIL"


def test_unigram_entropies_against_a_plain_count():
    rng = np.random.default_rng(5)
    train = rng.zipf(1.5, 4000) % 50
    val = np.concatenate([rng.zipf(1.5, 700) % 50, [57, 57, 58]])   # unseen in train
    res = learn_gpu.unigram(train, val, 60)
    counts = collections.Counter(train.tolist())
    n, v = len(train), 60
    cross = -sum(math.log((counts[t] + 1) / (n + v)) for t in val.tolist()) / len(val)
    own = -sum(c / n * math.log(c / n) for c in counts.values())
    vcounts = collections.Counter(val.tolist())
    vown = -sum(c / len(val) * math.log(c / len(val)) for c in vcounts.values())
    assert res["entropy"] == pytest.approx(cross, rel=1e-12)
    assert res["train_entropy"] == pytest.approx(own, rel=1e-12)
    assert res["val_entropy"] == pytest.approx(vown, rel=1e-12)
    assert res["val_tokens_unseen_in_train"] == 3 and res["vocab_size"] == 60


def test_the_corpus_is_the_stdlib_in_order_without_tests_or_packages(tmp_path):
    root = tmp_path / "lib"
    for rel, text in {"b.py": "b\n", "a/x.py": "x = 1\n" * 50,
                      "a/test/t.py": "t\n", "tests/u.py": "u\n", "site-packages/p/m.py": "m\n",
                      "c.txt": "not python\n", "d.py": "d = 4\n" * 50, "e.py": "e\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "c.py").write_bytes(b"s = '\xe9'\n")   # latin-1: skipped
    names = [p.relative_to(root).as_posix() for p in learn_gpu.stdlib_files(root)]
    assert names == ["a/x.py", "b.py", "c.py", "d.py", "e.py"]
    # x 300 bytes, b 2, c not UTF-8, d 300: 602 >= 500, e not read
    res = learn_gpu.build_corpus(root, tmp_path / "corpus", 500)
    assert (res["files"], res["bytes"], res["not_utf8_skipped"]) == (3, 602, 1)
    assert res["last_file"] == "d.py" and (tmp_path / "corpus/a/x.py").exists()
    again = learn_gpu.build_corpus(root, tmp_path / "corpus", 500)
    assert again["listing_sha256"] == res["listing_sha256"]
    assert sorted(p.name for p in (tmp_path / "corpus").rglob("*.py")) == ["b.py", "d.py", "x.py"]


def test_a_run_is_stopped_at_its_cap_and_killed_after_the_grace(tmp_path):
    env = cli_env()
    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    rc, started, secs, stopped = learn_gpu.run(sleeper, 1.5, tmp_path / "a.log", env, 5)
    assert stopped and rc == -15 and 1.4 < secs < 5, (rc, secs)
    deaf = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
            "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"]
    rc, started, secs, stopped = learn_gpu.run(deaf, 1.5, tmp_path / "b.log", env, 1)
    assert stopped and rc == -9 and 2.4 < secs < 6, (rc, secs)
    rc, started, secs, stopped = learn_gpu.run([sys.executable, "-c", "print(1)"], 30,
                                               tmp_path / "c.log", env)
    assert (rc, stopped) == (0, False) and secs < 20


def test_the_whole_flow_on_the_cpu(tmp_path):
    """gpt_tiny on a BPE of 300 tokens (the config's 256 bytes padded to 384),
    fp32 against fp32: the same curve twice, so the gap is 0 at every
    iteration; the entropy is the token file's own; the runs' checkpoints
    are gone and learn.json is in the report folder."""
    report = tmp_path / "report"
    report.mkdir()
    t = time.time()
    res = subprocess.run(
        [sys.executable, str(pathlib.Path(REPO) / "benchmarks/learn_gpu.py"),
         "--work", str(tmp_path / "w"), "--report-dir", str(report),
         "--config", str(pathlib.Path(REPO) / "jobs/gpt_tiny.yaml"), "--device", "-1",
         "--precisions", "fp32", "fp32", "--corpus-mb", "0.1", "--bpe-vocab", "300",
         "--batch", "2", "--seq", "64", "--iters", "4", "--eval-interval", "2",
         "--warmup", "1", "--budget-s", "300"],
        capture_output=True, text=True, env=cli_env(), timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert json.loads((report / "learn.json").read_text()) == out
    assert out["failed"] is None and out["corpus"]["bytes"] >= 100_000
    with h5py.File(tmp_path / "w/corpus.h5", "r") as f:
        assert int(f.attrs["vocab_size"]) == 300
        train, val = f["train/tokens"][:], f["val/tokens"][:]
    counts = collections.Counter(train.tolist())
    cross = -sum(math.log((counts[t] + 1) / (len(train) + 300)) for t in val.tolist()) / len(val)
    assert out["unigram"]["entropy"] == pytest.approx(cross, rel=1e-9)
    a, b = out["runs"]
    assert a["vocab_padded"] == 384 and a["rc"] == 0 and not a["stopped_at_cap"]
    assert [r["iter"] for r in a["curve"]] == [0, 2, 4] == [r["iter"] for r in b["curve"]]
    assert all(0 < r["seconds"] < time.time() - t for r in a["curve"] + b["curve"])
    # the untrained model's loss is about log(384); training lowers it
    assert abs(a["curve"][0]["loss"] - math.log(384)) < 0.5
    assert a["curve"][-1]["loss"] < a["curve"][0]["loss"]
    gap = out["verdicts"]["gap"]
    assert gap["verdict"] == "PASS" and gap["iter"] == 4 and gap["max_abs_gap"] == 0.0
    # a few seconds on a CPU: the loss stays above the entropy, an unfinished run
    assert out["verdicts"]["below_entropy"]["verdict"] == "INCOMPLETE"
    assert not [p for p in (tmp_path / "w").rglob("*.h5") if p.name != "corpus.h5"]
    for name in ("run0_fp32", "run1_fp32"):
        assert (report / f"learn_{name}_metrics.jsonl").exists()
    # the session's summary prints the verdicts
    summary = subprocess.run([sys.executable, str(pathlib.Path(REPO) /
                                                  "benchmarks/gpu_session_summary.py"),
                              str(report)], capture_output=True, text=True, timeout=60).stdout
    assert "learn.json: gap PASS: " in summary and "learn.json: below_entropy INCOMPLETE: " \
        in summary, summary


def test_learn_json_holds_the_verdicts_so_far_while_the_next_run_goes(tmp_path, monkeypatch):
    """A call killed during the fp32 run (the runner packs learn.json as it
    is then) still has the bf16 run's verdict: learn.json is rewritten with
    the verdicts so far after each run (the gap INCOMPLETE until the second
    has run), and its headline names the threshold for what it is, the
    unigram model's cross-entropy on the validation split."""
    stdlib = tmp_path / "lib"
    stdlib.mkdir()
    (stdlib / "a.py").write_text("x = 1\n" * 100)
    seen = []

    def run(cmd, cap_s, log_path, env, grace_s=30):
        out = pathlib.Path(cmd[cmd.index("--out") + 1])
        pathlib.Path(log_path).write_text("")
        if "data" in cmd:   # the token file: 4 tokens, the train split's frequencies
            with h5py.File(out, "w") as f:
                f.attrs["vocab_size"] = 4
                f["train/tokens"] = np.array([0, 0, 1, 2, 3, 0], np.int32)
                f["val/tokens"] = np.array([0, 1, 0, 2], np.int32)
            return 0, time.time(), 0.1, False
        if seen:   # the second run: what learn.json says while it goes, then a TERM
            seen.append(json.loads((tmp_path / "w/learn.json").read_text()))
            raise learn_gpu.Stopped()
        seen.append(None)
        out.mkdir(parents=True)
        t = time.time()
        rows = [{"phase": "test", "iter": i, "timestamp": t + i, "time": i, "loss": loss}
                for i, loss in ((0, 9.0), (50, 0.5))]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0, t, 51.0, False
    monkeypatch.setattr(learn_gpu, "run", run)
    rc = learn_gpu.main(["--work", str(tmp_path / "w"), "--stdlib", str(stdlib), "--config",
                         str(pathlib.Path(REPO) / "jobs/gpt_tiny.yaml"), "--device", "-1",
                         "--bpe-vocab", "4", "--budget-s", "300"])
    assert rc == 1 and len(seen) == 2
    during = seen[1]
    assert during["verdicts"]["below_entropy"]["verdict"] == "PASS", during.get("verdicts")
    assert during["verdicts"]["gap"]["verdict"] == "INCOMPLETE"
    assert any(line.startswith("below_entropy PASS: below the unigram cross-entropy ")
               for line in during["headline"]), during["headline"]
    assert any("threshold: the unigram cross-entropy" in line for line in during["headline"])
    final = json.loads((tmp_path / "w/learn.json").read_text())
    assert final["failed"].startswith("terminated") and \
        final["verdicts"]["below_entropy"]["verdict"] == "PASS"


def test_the_learn_stage_runs_the_script_inside_its_budget(tmp_path):
    """gpu_session.sh's learn stage: benchmarks/learn_gpu.py (a stand-in here
    that records its arguments) gets the stage's budget less the runner's
    margins, its work under cache/ (left out of the archive), its reports in
    the stage's folder."""
    import os
    import tarfile

    from tests.test_gpu_session import recording_python
    script = pathlib.Path(REPO) / "benchmarks/gpu_session.sh"
    plan = subprocess.run(["bash", str(script), "--plan"], capture_output=True, text=True,
                          env=cli_env(), timeout=60).stdout
    budget = int(next(line.split()[1] for line in plan.splitlines()
                      if line.startswith("learn ")).rstrip("s"))
    stub, calls = recording_python(tmp_path, "benchmarks/learn_gpu.py")
    work, back = tmp_path / "work", tmp_path / "out"
    res = subprocess.run(["bash", str(script), "learn"], capture_output=True, text=True,
                         env=dict(cli_env(), OUT=str(back), WORK=str(work), PYTHON=str(stub),
                                  WHEELS=str(tmp_path / "none"), PIP_FIND_LINKS=""),
                         timeout=120)
    assert res.returncode == 0, res.stderr
    args = calls.read_text().split()
    assert args[args.index("--work") + 1] == str(work / "cache/learn")
    assert args[args.index("--report-dir") + 1] == str(work)
    # the stage ends 5 s before its budget, the script 5 s before that
    assert budget - 30 <= int(args[args.index("--budget-s") + 1]) <= budget - 10, args
    assert "learn learn_gpu 0" in (work / "status.txt").read_text()
    with tarfile.open(back / "gpu_session.tgz") as tar:
        names = tar.getnames()
    assert "./learn.log" in names and not any("cache" in n for n in names), names
    assert sorted(os.listdir(back)) == ["gpu_session.tgz", "summary.txt"]
