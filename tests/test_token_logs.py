"""Logs a nanoGPT user reads at a glance (issue 46): on token data the
evaluation line names the split (``val``) and counts tokens, the metrics row
adds ``tokens``, and the val loss is evaluated at iteration 0 (off with
``solver.test_initialization: false``; image jobs keep no initial test);
``plot``'s throughput panel says tokens/s for token runs; the GPT jobs keep
intermediate checkpoints, so a run killed at 90 % keeps one. (The clock's
progress line carrying the loss: tests/test_habits_log.py, case 1.)"""
import glob
import json
import os
import re

import pytest

from purine_mpi.job.config import load_job
from tests.conftest import REPO, run_cli_args, small_net_config, write_config_file
from tests.gpt_nets import gpt_config, text_h5


def _rows(out):
    with open(os.path.join(str(out), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("initial", [None, False])
def test_token_job_says_val_counts_tokens_and_evaluates_at_iteration_0(tmp_path, initial):
    cfg = gpt_config(text_h5(tmp_path), iters=2)  # test_iter 2 of batch 4 x 8 tokens
    cfg["solver"]["test_interval"] = 2
    if initial is not None:
        cfg["solver"]["test_initialization"] = initial
    path = write_config_file(tmp_path, cfg)
    res = run_cli_args("train", path, "--out", tmp_path / "run")
    assert res.returncode == 0, res.stdout + res.stderr
    evals = re.findall(r"^(\w+) @ iter (\d+): loss [0-9.]+  \(([\d,]+) tokens\)$", res.stdout,
                       re.M)
    iters = ["2"] if initial is False else ["0", "2"]
    assert evals == [("val", it, "64") for it in iters], res.stdout
    assert "test @ iter" not in res.stdout and " samples)" not in res.stdout
    tests = [r for r in _rows(tmp_path / "run") if r["phase"] == "test"]
    assert [r["iter"] for r in tests] == [int(i) for i in iters]
    assert all(r["tokens"] == 64 and r["samples"] == 8 for r in tests), tests


def test_image_job_keeps_its_test_line_and_no_initial_test(tmp_path, digits_h5):
    path = write_config_file(tmp_path, small_net_config(digits_h5))
    res = run_cli_args("train", path, "--out", tmp_path / "run", "--iters", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"^test @ iter 2: loss [0-9.]+  accuracy [0-9.]+  \(360 samples\)$",
                     res.stdout, re.M), res.stdout
    tests = [r for r in _rows(tmp_path / "run") if r["phase"] == "test"]
    assert [r["iter"] for r in tests] == [2] and "tokens" not in tests[0]


def test_plot_throughput_panel_says_tokens_for_token_runs():
    pytest.importorskip("matplotlib")
    from purine_mpi.tools.plot import draw
    tokens = [{"phase": "train", "iter": i, "loss": 1.0, "lr": 0.1, "images_per_s": 10.0 * i,
               "tokens_per_s": 2560.0 * i} for i in (1, 2, 3)]
    images = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in tokens]
    ax = draw([("gpt", tokens)]).axes[3]
    assert ax.get_ylabel() == "tokens/s"
    assert list(ax.get_lines()[0].get_ydata()) == [2560.0, 5120.0, 7680.0]
    ax = draw([("lenet", images)]).axes[3]
    assert ax.get_ylabel() == "images/s"
    assert list(ax.get_lines()[0].get_ydata()) == [10.0, 20.0, 30.0]


@pytest.mark.parametrize("job", sorted(glob.glob(os.path.join(REPO, "jobs", "gpt_*.yaml"))))
def test_gpt_jobs_keep_intermediate_checkpoints(job):
    """A run killed (SIGKILL: no checkpoint on the way out) at 90 % of its
    iterations, or at any point past the first tenth, keeps a checkpoint at
    most a tenth of the run old."""
    j = load_job(job, [], None, check_files=False)
    interval, max_iter = j.checkpoint.interval, j.solver.max_iter
    assert interval > 0 and j.checkpoint.keep >= 1
    assert interval * 10 <= max_iter, (interval, max_iter)
    killed = int(0.9 * max_iter)
    assert killed - (killed // interval) * interval <= max_iter // 10 and killed >= interval
