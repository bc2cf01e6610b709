"""``bench --json``'s throughput against the wall clock of the same
iterations (closed form: timed iterations x global batch / their elapsed
time), in-process on one rank."""
import time

import pytest

from tests.conftest import make_job


def test_bench_reports_the_elapsed_throughput_of_its_timed_iterations(monkeypatch):
    """``images_per_s`` is the median iteration's: one slow iteration (here
    60 ms of a host's noise) does not move it, so a noisy host's figure was
    above what those iterations achieved, with no figure of the wall clock.
    ``images_per_s_elapsed`` is now iterations x batch / elapsed, as a
    stopwatch around the timed iterations reads it (warm-up excluded)."""
    from purine_mpi.tools.bench import run_bench
    from purine_mpi.train import trainer as trainer_mod
    job = make_job({
        "name": "tiny", "seed": 1,
        "data": {"train": {"source": "synthetic", "shape": [1, 8, 8], "classes": 10,
                           "num_samples": 64, "batch_size": 16}},
        "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 10},
                {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"],
                 "top": "loss"}],
        "solver": {"base_lr": 0.01, "max_iter": 10, "display": 0, "test_interval": 0},
        "checkpoint": {"interval": 0}})
    iters, warmup, stamps = 8, 2, []
    step = trainer_mod.Trainer.step

    def timed(self, it, *args, **kwargs):
        if it == warmup + 3:
            time.sleep(0.06)  # one slow timed iteration
        out = step(self, it, *args, **kwargs)
        stamps.append(time.perf_counter())
        return out

    monkeypatch.setattr(trainer_mod.Trainer, "step", timed)
    res = run_bench(job, iters, warmup)
    assert len(stamps) == warmup + iters
    elapsed = stamps[-1] - stamps[warmup - 1]  # from the last warm-up's end
    want = iters * 16 / elapsed
    assert res["images_per_s_elapsed"] == pytest.approx(want, rel=0.03), (res, want)
    assert res["iter_ms_mean"] == pytest.approx(elapsed / iters * 1000, rel=0.03)
    assert res["images_per_s"] > 1.2 * res["images_per_s_elapsed"]  # the median skips the sleep
