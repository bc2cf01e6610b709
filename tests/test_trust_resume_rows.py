"""A train row's ``loss`` is the mean over the iterations since the last row
(docs/formats.md), also when the run was resumed from a checkpoint written
between two rows (``checkpoint.interval`` not a multiple of
``solver.display``, a SIGTERM or SIGUSR1 stop): the checkpoint holds each
rank's display window, so the resumed run's rows are the uninterrupted
run's.

The reference is the uninterrupted run. Before the fix the first row after
the resume averaged only the iterations after the checkpoint (0.80152 at
iteration 20 for 0.87757: iterations 16-20 under the label of 11-20).
"""
import json

from tests.conftest import run_cli_args, small_net_config, write_config_file

CLOCK = ("time", "timestamp", "images_per_s")


def _rows(out):
    return [{k: v for k, v in json.loads(line).items() if k not in CLOCK}
            for line in open(out / "metrics.jsonl")]


def test_a_resume_between_two_rows_gives_the_uninterrupted_rows(digits_h5, tmp_path):
    cfg = small_net_config(digits_h5, checkpoint={"interval": 15, "keep": 5})
    cfg["solver"].update(max_iter=30, display=10, test_interval=0)
    path = write_config_file(tmp_path, cfg)
    out = tmp_path / "run"
    res = run_cli_args("train", path, "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    straight = _rows(out)
    assert [r["iter"] for r in straight if r["phase"] == "train"] == [10, 20, 30]
    # the same folder from its checkpoint at 15, five iterations into a window
    res = run_cli_args("train", path, "--out", out, "--resume", out / "ckpt_15.h5")
    assert res.returncode == 0, res.stdout + res.stderr
    resumed = _rows(out)
    assert [(r["phase"], r["iter"]) for r in resumed] == \
        [(r["phase"], r["iter"]) for r in straight]
    for a, b in zip(resumed, straight):
        assert a == b, f"resumed at 15: row {a}, the uninterrupted run's {b}"


def test_the_device_loss_window_carries_over_a_resume(host_build_dir, monkeypatch, tmp_path):
    """The same on the emulated GPU, whose loss stays on the device between
    the intervals (ops/watch.py): resumed from the checkpoint at 6, inside
    the display window 5-8, the rows are those of the uninterrupted run."""
    from purine_mpi.parallel.schemes import scheme_of
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.conftest import FakeWorld, make_job
    from tests.emulated_gpu import emulated_trainer_env
    from tests.test_loss_watch import _config
    emulated_trainer_env(monkeypatch, host_build_dir)
    # the job's registered scheme (the trainer asks it; the stand-in has no
    # capability of its own)
    monkeypatch.setattr(type(scheme_of(make_job(_config()))), "defer_loss_readback", True)
    out = tmp_path / "gpu"

    def train(resume=None):
        t = Trainer(make_job(_config(max_iter=12, display=4, interval=6)), str(out),
                    world=FakeWorld(), log=lambda line: None, resume=resume)
        assert run_and_report(t, FakeWorld()) == 0
        assert t.graphs.watch is not None  # the deferred path
        return _rows(out)
    straight = train()
    assert [r["iter"] for r in straight if r["phase"] == "train"] == [4, 8, 12]
    resumed = train(str(out / "ckpt_6.h5"))
    assert resumed == straight, f"resumed at 6: {resumed}, uninterrupted: {straight}"
