"""``solver.clip_gradients`` under ``parallel.scheme: sharded`` (issue 43):
the global norm from the shards' float64 sums of squares (ops/clip.py
accumulates every gradient's squared norm in float64, so a parameter cut
into shards gives the norm its whole gives to ~1e-16), so the float32 clip
factor, and with it the training, is data parallelism's bit for bit."""
import numpy as np
import pytest

from tests.test_micro_batches import _params
from tests.test_sharded import _job, _train


@pytest.mark.mpi
def test_clipped_adamw_bitwise_as_data_parallel_every_stage(tmp_path):
    """2 ranks, 10 AdamW steps, a clip acting every step (the norm is far
    above 0.05): stages 1, 2 and 3 write data parallelism's weights and
    moments bit for bit."""
    runs = {}
    for name, scheme, par in (("data", "data", {}), ("s1", "sharded", {"shard": 1}),
                              ("s2", "sharded", {"shard": 2}), ("s3", "sharded", {"shard": 3})):
        cfg = _job(scheme, "adamw", iters=10, **par)
        cfg["solver"]["clip_gradients"] = 0.05
        runs[name] = _params(_train(tmp_path, name, 2, cfg)[0] / "latest.h5")
    assert any(k.startswith("solver/") for k in runs["data"])
    for name in ("s1", "s2", "s3"):
        assert sorted(runs[name]) == sorted(runs["data"]), name
        for k, want in runs["data"].items():
            assert np.array_equal(want, runs[name][k]), (name, k)
