"""A resume from an earlier checkpoint of the run folder replaces the
continuation after it: the best checkpoints (``checkpoint.best``) that
continuation wrote are not this run's best ones. ``keep`` holds for the
resumed run: its best files are those of its own test passes and the list
its checkpoint carried (the reference: the metrics.jsonl test rows of the
resumed run and the kept list of its latest.h5). So are its newest
checkpoints: the replaced continuation's ckpt_<iter>.h5 of later iterations
are neither counted by the rotation nor what ``--resume auto`` falls back
to when latest.h5 does not load.

Before the fix a resume from ckpt_20.h5 of a run that went on to 60 (best
at 40) and stopped at 30 left best_40.h5 on disk beside its best_30.h5
with ``keep: 1``, never rotated, which latest.h5's list did not name; and
ckpt_40.h5, ckpt_60.h5, the "newest" checkpoints, of the replaced run.
"""
import json
import os

from purine_mpi.job.checkpoint_file import load_checkpoint
from purine_mpi.job.run_checkpoints import find_latest
from tests.conftest import run_cli_args, small_net_config, write_config_file


def _tests(out):
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [(r["iter"], r["accuracy"]) for r in rows if r["phase"] == "test"]


def test_a_rewound_resume_rotates_the_replaced_best_files(digits_h5, tmp_path):
    cfg = small_net_config(digits_h5, checkpoint={
        "interval": 20, "keep": 5, "best": {"metric": "accuracy", "mode": "max", "keep": 1}})
    cfg["solver"].update(max_iter=60, display=0, test_interval=10)
    path = write_config_file(tmp_path, cfg)
    out = tmp_path / "run"
    res = run_cli_args("train", path, "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in out.glob("ckpt_*.h5")) == ["ckpt_20.h5", "ckpt_40.h5",
                                                              "ckpt_60.h5"]
    res = run_cli_args("train", path, "--out", out, "--iters", "30",
                       "--resume", out / "ckpt_20.h5")
    assert res.returncode == 0, res.stdout + res.stderr
    tests = _tests(out)
    assert [it for it, _ in tests] == [10, 20, 30]
    best = max(tests, key=lambda t: (t[1], -t[0]))
    kept = load_checkpoint(str(out / "latest.h5")).state["watch"]["best"]["kept"]
    assert [it for _, it, _ in kept] == [best[0]]
    on_disk = sorted(p.name for p in out.glob("best_*.h5"))
    assert on_disk == [f"best_{best[0]}.h5"], \
        f"best files on disk {on_disk} after the resume from ckpt_20.h5 to 30, the run's " \
        f"list (keep 1) {kept}, its best pass {best}"
    ckpts = sorted(p.name for p in out.glob("ckpt_*.h5"))
    assert ckpts == ["ckpt_20.h5", "ckpt_30.h5"], \
        f"checkpoints {ckpts} after the resume from ckpt_20.h5 to 30"
    assert "removed ckpt_40.h5, ckpt_60.h5, best_40.h5: written after iteration 20 " in res.stdout
    # the list of ckpt_20.h5 named the best pass so far, whose file the run
    # to 60 deleted as a better pass came: said, not hidden
    gone = load_checkpoint(str(out / "ckpt_20.h5")).state["watch"]["best"]["kept"][0][2]
    assert f"names {gone}, not in {out}" in res.stdout, res.stdout
    os.remove(out / "latest.h5")  # --resume auto's fallback: the run's newest checkpoint
    assert os.path.basename(find_latest(str(out))) == "ckpt_30.h5"
