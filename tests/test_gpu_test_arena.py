"""The test graph reuses the training graph's device arena on a GPU, as it
does the host arena (runtime/workspace.py ``device_arenas``): the test
workspace's planned blobs are views into the training workspace's planned
region of each device, which the training workspace makes as large as the
test's where that is larger (``room``: the two take the larger's bytes, not
their sum); ``plan`` counts the device arena so (runtime/footprint.py: what
the test's planned region adds where it exceeds the training one's).

On the emulated device (tests/emulated_gpu: streams run in random
interleavings that respect only the recorded events), CUDA graphs on:

- a job with a test pass every 2 iterations trains, tests and ends with
  the same bytes as the same job whose test workspace has arenas of its
  own (the planned bytes filled with garbage first);
- the test workspace's planned region is the training one's, grown to
  the test's where that is larger, and ``device_bytes``/``allocated_bytes``
  say so;
- ``plan``'s device rows are the two workspaces' device bytes to the byte,
  its activations row the larger of the two planned regions;
- a test pass starts after the training iteration's queued device work is
  drained and ends synchronised (the two points the graphs meet).
"""
import json

import numpy as np
import pytest

from purine_mpi.base.backend import to_numpy
from purine_mpi.job.config import validate_config
from tests.conftest import FakeWorld, make_job
from tests.emulated_gpu import emulated_trainer_env, tiny_raw


def _raw(test_batch):
    raw = tiny_raw(device=0, cuda_graph=True)
    raw["data"]["test"] = dict(raw["data"]["train"], num_samples=test_batch * 2,
                               batch_size=test_batch, shuffle=False)
    raw["solver"].update(max_iter=5, test_interval=2, display=1)
    return raw


def _trainer(tmp_path, raw, out):
    from purine_mpi.train.trainer import Trainer
    config = validate_config(raw, check_files=False)
    return Trainer(make_job(config), str(tmp_path / out), world=FakeWorld(), log=lambda m: None)


def _region_bytes(ws):
    return {d: plan.total_bytes for d, plan in ws.device_plans.items() if plan.offsets}


def _train(tmp_path, raw, out):
    trainer = _trainer(tmp_path, raw, out)
    try:
        ws, tws = trainer.ws, trainer.test.workspace
        for w in (ws, tws):  # stale bytes must never reach a result
            for region in w.device_arenas.values():
                region[...] = 255
        shared = tws.device_arenas[0] is ws.device_arenas[0]
        trainer.run()
        params = {p: np.array(to_numpy(ws[p])) for p in trainer.graphs.params}
        for d in (trainer.train, trainer.test):
            report = d.capture_report()
            assert report["captured"] >= 1 and report["failed"] == {}, report
    finally:
        trainer.close()
    rows = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
    drop = ("time", "timestamp", "images_per_s")
    return params, [{k: v for k, v in json.loads(r).items() if k not in drop} for r in rows], \
        shared


def test_training_with_the_shared_device_arena_is_bitwise_with_arenas_apart(
        host_build_dir, monkeypatch, tmp_path):
    import purine_mpi.gpu as gpu
    import purine_mpi.train.trainer as trainer_module
    emulated_trainer_env(monkeypatch, host_build_dir)
    raw = _raw(8)
    try:
        shared = _train(tmp_path, raw, "shared")
        real = trainer_module.planned_workspace
        # reuse switched off: the test workspace gets arenas of its own
        monkeypatch.setattr(trainer_module, "planned_workspace",
                            lambda *a, **kw: real(*a, **dict(kw, arena=None)))
        apart = _train(tmp_path, raw, "apart")
    finally:
        gpu.clear_kernel_cache()
    assert shared[2] and not apart[2]
    assert sum(r.get("phase") == "test" for r in shared[1]) >= 3
    assert shared[1] == apart[1]
    for name, value in apart[0].items():
        assert shared[0][name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("test_batch", [8, 64])
def test_the_test_workspace_reuses_the_device_region_when_it_fits_and_plan_counts_it(
        host_build_dir, monkeypatch, tmp_path, test_batch):
    """Test batch 8 (the training's): the test region fits in the training
    one; 64: it does not, and the training workspace's region grows to it
    (before: the test workspace allocated one of its own, the two summed)."""
    from purine_mpi.tools.plan import offline_footprint
    emulated_trainer_env(monkeypatch, host_build_dir)
    raw = _raw(test_batch)
    trainer = _trainer(tmp_path, raw, "run")
    try:
        ws, tws = trainer.ws, trainer.test.workspace
        train_region, test_region = _region_bytes(ws)[0], _region_bytes(tws)[0]
        assert (test_region <= train_region) == (test_batch == 8)
        assert ws.device_arenas[0].nbytes == max(train_region, test_region)
        # the test workspace's arena holds its roots but the planned ones;
        # those are views into the training workspace's region
        own = tws._arena[0]
        planned = [r for r in tws.device_plans[0].offsets]
        assert planned
        for root in planned:
            assert np.shares_memory(tws.storage(root), ws.device_arenas[0]), root
            assert not np.shares_memory(tws.storage(root), own), root
        assert tws.device_arenas[0] is ws.device_arenas[0]
        assert tws.device_bytes[0] == own.nbytes or tws.device_bytes[0] == 0
        assert ws.device_bytes[0] == ws._arena[0].nbytes
        allocated = ws.device_bytes[0] + tws.device_bytes[0]
    finally:
        trainer.close()
    fp = offline_footprint(make_job(validate_config(raw, check_files=False)), 1, 0)
    rows = fp.devices[0]
    blobs = sum(n for row, n in rows.items()
                if row not in ("scratch", "cublas_workspaces", "capture_pools"))
    assert blobs == allocated, (rows, allocated)
    assert rows["activations"] == max(train_region, test_region)


def test_a_test_pass_starts_after_the_training_work_and_ends_synchronised(
        host_build_dir, monkeypatch, tmp_path):
    """The two points where the graphs meet in the shared bytes: the
    training iteration's device work (queued, not waited for: a deferred
    step) is drained before the pass's first run, and the pass ends
    synchronised before training resumes."""
    import purine_mpi.gpu as gpu
    emulated_trainer_env(monkeypatch, host_build_dir)
    trainer = _trainer(tmp_path, _raw(8), "run")
    calls = []
    try:
        assert trainer.graphs.deferred
        trainer.ws["iter"][...] = 0
        trainer.train.run(0, sync=False)  # a step as the loop runs it: queued
        for d, name in ((trainer.train, "train"), (trainer.test, "test")):
            for method in ("run", "drain", "synchronize"):
                real = getattr(d, method)
                monkeypatch.setattr(d, method, lambda *a, _r=real, _m=f"{name}.{method}", **kw: (
                    calls.append(_m), _r(*a, **kw))[1])
        trainer.evaluate()
    finally:
        trainer.close()
        gpu.clear_kernel_cache()
    runs = [i for i, c in enumerate(calls) if c == "test.run"]
    assert runs and "train.drain" in calls[:runs[0]], calls
    assert not any(c.startswith("train.") for c in calls[runs[0]:]), calls
    assert calls[-1] == "test.synchronize", calls
