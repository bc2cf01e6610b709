"""A resumed run keeps what its test passes decided: the best-k checkpoints
(``checkpoint.best``) and early stopping's best figure and patience
(``solver.early_stop``) carry over a checkpoint, so the run stopped and
resumed ends as the uninterrupted run (the same best files, lines and
``final``).

The reference is the uninterrupted run. Before the fix a resume forgot both:
the first test pass after it was "best" whatever came before (a second
best_<iter>.h5 beside the first with ``keep: 1``, and a line naming it the
best), and early stopping counted its patience afresh (the run stopped 20
iterations later than the uninterrupted one).
"""
import json

import pytest

from tests.conftest import final_figures, run_cli_args, small_net_config, write_config_file


def _config(digits_h5, watch):
    # accuracy, "min": the best pass is an early one, so a pass after the
    # resume is never better than those before it
    cfg = small_net_config(digits_h5, checkpoint={"interval": 20, "keep": 5, **watch.get(
        "checkpoint", {})})
    cfg["solver"].update(max_iter=60, display=0, test_interval=10, **watch.get("solver", {}))
    return cfg


def _runs(tmp_path, cfg):
    """(uninterrupted, resumed at 20): each (run dir, stdout, final figures)."""
    path = write_config_file(tmp_path, cfg)
    out = {}
    for name, stops in (("straight", [None]), ("split", ["20", None])):
        text = ""
        for i, iters in enumerate(stops):
            args = ["--iters", iters] if iters else []
            res = run_cli_args("train", path, "--out", tmp_path / name, *args,
                               *(["--resume", "auto"] if i else []))
            assert res.returncode == 0, res.stdout + res.stderr
            text += res.stdout
        out[name] = (tmp_path / name, text, final_figures(res))
    return out


def _tests(out):
    return [(r["iter"], r["accuracy"]) for r in map(json.loads, open(out / "metrics.jsonl"))
            if r["phase"] == "test"]


def test_best_checkpoints_carry_over_a_resume(digits_h5, tmp_path):
    runs = _runs(tmp_path, _config(digits_h5, {"checkpoint": {
        "best": {"metric": "accuracy", "mode": "min", "keep": 1}}}))
    straight, split = runs["straight"], runs["split"]
    assert _tests(split[0]) == _tests(straight[0])  # the same passes, bit for bit
    best = min(_tests(straight[0]), key=lambda t: (t[1], t[0]))
    for name, (out, text, _) in runs.items():
        kept = sorted(p.name for p in out.glob("best_*.h5"))
        assert kept == [f"best_{best[0]}.h5"], \
            f"{name}: best checkpoints {kept}, expected only best_{best[0]}.h5 " \
            f"(accuracy {best[1]}, the lowest of {_tests(out)}; keep 1)"
        lines = [line for line in text.splitlines() if line.startswith("best accuracy")]
        assert lines and all(f"at iteration {best[0]} " in line for line in lines), \
            f"{name}: {lines} name another pass than iteration {best[0]}"
    # a best checkpoint holds the list with itself in it: resumed from, it
    # goes on as the run did after that pass
    from purine_mpi.job.checkpoint_file import load_checkpoint
    watch = load_checkpoint(str(straight[0] / f"best_{best[0]}.h5")).state["watch"]
    assert watch["best"]["kept"] == [[pytest.approx(best[1]), best[0], f"best_{best[0]}.h5"]]


def test_early_stopping_carries_over_a_resume(digits_h5, tmp_path):
    runs = _runs(tmp_path, _config(digits_h5, {"solver": {
        "early_stop": {"metric": "accuracy", "mode": "min", "patience": 2}}}))
    (_, text, final), (_, split_text, split_final) = runs["straight"], runs["split"]
    assert "early_stop" in final, text
    assert split_final.get("early_stop") == final["early_stop"], \
        f"resumed at 20: early_stop {split_final.get('early_stop')}, the uninterrupted run " \
        f"stopped at {final['early_stop']}"
    assert split_final == pytest.approx(final)
    stop = [line for line in text.splitlines() if line.startswith("early stop")]
    assert stop and stop == [line for line in split_text.splitlines()
                             if line.startswith("early stop")]
