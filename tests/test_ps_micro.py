"""Micro-batches under the parameter-server modes (``parallel.mode:
sync_ps | async``): a worker copies its forward and backward M times, sums
its M micro-batch gradients in place into the gradient it pushes
(micro_batch._sum_in_place, as schemes data and none), and the servers
divide their updates by M as well (param_server.scale_for_micro_batches).
Before, the config refused them: 'parameter-server mode 'sync_ps' takes no
micro-batches; use mode: sync'."""
import dataclasses

import numpy as np
import pytest

from purine_mpi.job.config import dump_config, load_job
from tests.mpi_scripts.common import mlp_config
from tests.test_micro_inplace import _mpi_train


def _cfg(mode, m, batch=12, iters=4):
    cfg = mlp_config(batch=batch, hidden=(64, 32), shape=(1, 8, 8), classes=5,
                     solver={"max_iter": iters},
                     parallel={"mode": mode, "ps_ranks": 1, "micro_batches": m,
                               "max_staleness": 1})
    return cfg


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ["two_sided", "one_sided"])
def test_sync_ps_micro_batches_train_bitwise_as_separate_sums_and_as_one_batch(tmp_path,
                                                                               transport):
    """3 ranks of sync_ps (2 workers, 1 server; Send/Recv or windows), 3
    micro-batches of 4, 4 SGD steps with momentum: the weights and the
    servers' momenta in the checkpoint are those of separate running sums
    (the same additions) bit for bit, and those of one batch of 12 a
    worker to float rounding (without the servers' 1/M the steps were 3
    times as large: 'Mismatched elements: 64 / 64')."""
    def cfg(m):
        return _cfg("sync_ps", m).replace(parallel=dataclasses.replace(
            _cfg("sync_ps", m).parallel, transport=transport))
    new = _mpi_train(tmp_path, "new", 3, cfg(3))
    old = _mpi_train(tmp_path, "old", 3, cfg(3), old=True)
    one = _mpi_train(tmp_path, "one", 3, cfg(1))
    assert sorted(new) == sorted(old) == sorted(one)
    assert any(k.startswith("solver/") for k in new)
    for k in old:
        assert np.array_equal(new[k], old[k]), k
        np.testing.assert_allclose(new[k], one[k], rtol=1e-4, atol=1e-6, err_msg=k)


def _job(tmp_path, mode, m):
    path = tmp_path / f"{mode}{m}.yaml"
    path.write_text(dump_config(_cfg(mode, m)))
    return load_job(str(path), (), None, check_files=False)


@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_servers_scale_their_updates_by_the_micro_batches(tmp_path, mode):
    """Each server's update of a worker's push (the sync_ps server graph's
    SGDUpdate, the async loop's kernels' attrs: both from ServerRank's
    graph) scales the gradient by 1/M more than without micro-batches."""
    from purine_mpi.parallel.param_server import served_params
    from purine_mpi.tools.graph import _OfflineWorld
    from purine_mpi.train.ps_server import ServerRank

    def scales(m):
        server = ServerRank(_job(tmp_path, mode, m), _OfflineWorld(2, 3))
        graph = server.server_graph if server.server_graph is not None else server.graph
        return {p: op.attrs.get("grad_scale", 1.0) for p, op in served_params(graph).items()}
    one, three = scales(1), scales(3)
    assert sorted(one) == sorted(three) and one
    for p in one:
        assert three[p] == pytest.approx(one[p] / 3), p


@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_workers_plan_one_gradient_sum_less_in_place(tmp_path, monkeypatch, mode):
    """A worker's plan at 3 micro-batches holds less with the sums in place
    than with separate running sums (which also live from copy 0's
    backward to the last's: here fc1's 64 x 64 gradient, 16 KiB); the
    server's is unchanged by the micro-batches."""
    from purine_mpi.tools.plan import offline_footprints
    import purine_mpi.parallel.micro_batch as mb

    def plan(m):
        fps, _ = offline_footprints(_job(tmp_path, mode, m), 3, [0, 2])
        return fps[0].loop_total, fps[2].loop_total
    one, new = plan(1), plan(3)
    monkeypatch.setattr(mb, "_sum_in_place", lambda *a, **k: None)
    old = plan(3)
    assert new[0] <= old[0] - 64 * 64 * 4, (one, new, old)
    assert new[1] == one[1] == old[1]


@pytest.mark.parametrize("micro", [1, 2])
def test_a_worker_counts_its_ignored_labels_over_its_own_micro_batches(tmp_path, micro):
    """A worker's loss with an ignore_label (``ignore_label_mean:
    global``) is its own batch's mean: with micro-batches its copy 0's
    reader counts the worker's batch (``count_over: replica``), not every
    worker's (its push updates the servers on its own); with one
    micro-batch, no count (its plain mean), as before."""
    from purine_mpi.tools.graph import composed
    from tests.conftest import make_job
    from tests.test_trust_step_oracle import IGNORE, _config, _data
    job = make_job(_config(_data(tmp_path / "d.h5"), "sgd",
                           {"mode": "sync_ps", "ps_ranks": 1, "micro_batches": micro}))
    graph = composed(job, 3, 1)[0]
    readers = [(op.attrs["count_label"], op.attrs.get("count_over"))
               for op in graph.ops.values() if op.op_type == "DataReader" and
               op.attrs.get("count_label") is not None]
    assert readers == ([(IGNORE, "replica")] if micro > 1 else []), readers


def _losses(out):
    import json
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("phase") == "train"]


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["clip", "ignore_label"])
def test_sync_ps_micro_batches_clip_decay_and_ignored_labels_as_one_batch(tmp_path, case):
    """3 ranks of sync_ps (2 workers, 1 server), M micro-batches against one
    batch a worker: with ``clip_gradients`` 0.05 (clipping every step: the
    server's norm is of its updates' scaled gradients, 1/(W M)) and weight
    decay 0.5 (not scaled by 1/M: a step applies it once), M = 3; with a
    loss whose ignore_label count differs between the micro-batches
    (test_trust_step_oracle's data; ``ignore_label_mean: global``: a
    worker's batch mean), M = 2 and 4. The weights and the servers'
    momenta agree to float rounding, and so do the reported losses of every
    iteration (each the mean over the micro-batches, not their sum or the
    last one's). Checked to fail: with the servers' weight decay divided by
    M too, 'Mismatched elements: 59 / 64' (clip) and '6 / 6'
    (ignore_label); without the servers' 1/M the ignore_label case fails
    ('6 / 6'), the clip case not (a clip active at every step takes the
    gradient to the same norm at any scale)."""
    if case == "clip":
        def cfg(m):
            base = _cfg("sync_ps", m)
            return base.replace(solver=dataclasses.replace(
                base.solver, clip_gradients=0.05, weight_decay=0.5, display=1))
        ms = (3,)
    else:
        from tests.conftest import make_job
        from tests.test_trust_step_oracle import _config, _data
        data = _data(tmp_path / "d.h5")

        def cfg(m):
            raw = _config(data, "sgd", {"mode": "sync_ps", "ps_ranks": 1, "micro_batches": m})
            raw["solver"]["display"] = 1
            raw["checkpoint"] = {"interval": 0}
            return make_job(raw)
        ms = (2, 4)
    one = _mpi_train(tmp_path, "one", 3, cfg(1))
    for m in ms:
        got = _mpi_train(tmp_path, f"m{m}", 3, cfg(m))
        assert sorted(got) == sorted(one) and any(k.startswith("solver/") for k in got)
        for k in one:
            np.testing.assert_allclose(got[k], one[k], rtol=1e-4, atol=1e-6, err_msg=(m, k))
        np.testing.assert_allclose(_losses(tmp_path / f"m{m}"), _losses(tmp_path / "one"),
                                   rtol=1e-5)
    if case == "clip":   # the clip was on: one batch without it takes other steps
        free = _mpi_train(tmp_path, "free", 3, cfg(1).replace(solver=dataclasses.replace(
            cfg(1).solver, clip_gradients=None)))
        assert not np.allclose(free["params/fc1/weight"], one["params/fc1/weight"],
                               rtol=1e-3, atol=1e-5)
