"""The loss read back only at display, test and checkpoint intervals on a GPU
(ops/watch.py, cuda/loss_watch.cu, the trainer's deferred path).

On the emulated device (tests/emulated_gpu): the watch kernel equals
the host sum bit for bit; the trainer reads nothing from the device between
its intervals; the displayed loss is the one of the same run reading the
loss every iteration; a divergence at iteration k is reported as k with exit
3, and latest.h5 stays the last finite checkpoint."""
import json
import math

import numpy as np
import pytest

import purine_mpi.base.backend as backend
from purine_mpi.graph.core import Op
from purine_mpi.job.config import validate_config
from purine_mpi.ops.catalog import get_kernel_class
from tests.conftest import FakeWorld, make_job
from tests.emulated_gpu import DeviceArray, emulated_trainer_env, tiny_raw


def _watch(shares):
    cls = get_kernel_class("LossWatch")
    return cls(Op("w", "LossWatch", [], [], {"shares": list(shares)}))


def _host_reference(history, shares):
    """The trainer's host loop: sum(float(loss) * share) per iteration, the
    window sum, the first non-finite iteration (counted from 1)."""
    total, first = 0.0, 0
    for it, losses in enumerate(history):
        now = sum(float(v) * s for v, s in zip(losses, shares))
        total = total + now
        if not math.isfinite(now) and first == 0:
            first = it + 1
    return total, first


def _history(dtype, n_iter=9, bad=(5, 7)):
    rng = np.random.default_rng(1)
    history = [list(rng.standard_normal(3).astype(dtype) * 3) for _ in range(n_iter)]
    history[bad[0]][1] = np.inf
    history[bad[1]][0] = np.nan
    return history


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_watch_op_on_the_cpu_is_the_host_loop(dtype):
    shares = [0.5, 0.25, 0.25]
    history = _history(dtype)
    k = _watch(shares)
    out = np.full(2, np.nan)
    k.setup([], [out])
    for n in range(1, len(history) + 1):
        k.run([np.asarray(v) for v in history[n - 1]] + [np.asarray(n - 1, np.int64)], [out])
        total, first = _host_reference(history[:n], shares)
        assert out[1] == first
        assert out[0] == total or (math.isnan(total) and math.isnan(out[0]))
    assert out[1] == 6  # iteration index 5, the 6th iteration


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_watch_kernel_on_the_emulated_device_is_the_cpu_bit_for_bit(
        host_build_dir, monkeypatch, dtype):
    from tests.emulated_gpu import use_emulated_cupy
    import purine_mpi.gpu as gpu
    use_emulated_cupy(monkeypatch, host_build_dir)
    shares = [1 / 3, 0.7, 1e-3]
    history = _history(dtype, bad=(6, 3))
    history[2] = [dtype(1e30), dtype(-1e30), dtype(1e-30)]  # cancellations: order matters
    cpu, dev = _watch(shares), _watch(shares)
    host_out = np.zeros(2)
    losses = [np.zeros(1, dtype).view(DeviceArray) for _ in shares]
    it = np.zeros(1, np.int64).view(DeviceArray)
    out = np.full(2, 7.0).view(DeviceArray)
    dev.setup([], [out])
    try:
        for n, values in enumerate(history):
            for a, v in zip(losses, values):
                a[...] = v
            it[...] = n
            dev.run(losses + [it], [out])
            cpu.run([np.asarray(v) for v in values] + [np.asarray(n, np.int64)], [host_out])
            assert np.asarray(out).tobytes() == host_out.tobytes(), n
        assert host_out[1] == 4  # the first bad one (index 3), not the later NaN
    finally:
        gpu.clear_kernel_cache()


# ------------------------------------------------------------ the trainer

class ReadBacks:
    """Device -> host reads on the emulated device, by the iteration the
    trainer last started (``Trainer.step``)."""

    def __init__(self, monkeypatch):
        from purine_mpi.train.trainer import Trainer
        self.by_iter, self.current = {}, None
        real_step = Trainer.step

        def step(trainer, it):
            self.current = it
            return real_step(trainer, it)

        monkeypatch.setattr(Trainer, "step", step)
        for name in ("get", "__float__", "__int__", "__bool__", "__index__", "item", "tolist"):
            real = getattr(np.ndarray, name, None)
            if name == "get":
                real = DeviceArray.get
            monkeypatch.setattr(DeviceArray, name, self._spy(name, real), raising=False)
        fake = backend._cupy
        monkeypatch.setattr(fake, "asnumpy", self._spy("asnumpy", fake.asnumpy), raising=False)

    def _spy(self, what, real):
        def spy(*args, **kw):
            if self.current is not None:
                self.by_iter.setdefault(self.current, []).append(what)
            return real(*args, **kw)
        return spy


def _config(max_iter=12, display=4, interval=6, device=0, cuda_graph=True, **solver):
    raw = tiny_raw(device=device, checkpoint={"interval": interval, "keep": 20},
                    cuda_graph=cuda_graph)
    raw["solver"].update(max_iter=max_iter, display=display, test_interval=0, **solver)
    return validate_config(raw, check_files=False)


def _run(config, out, defer=True, monkeypatch=None):
    from purine_mpi.parallel.schemes import scheme_of
    from purine_mpi.train.trainer import Trainer, run_and_report
    job = make_job(config)
    # the job's registered scheme (the trainer asks it, not a stand-in)
    monkeypatch.setattr(type(scheme_of(job)), "defer_loss_readback", defer)
    lines = []
    t = Trainer(job, str(out), world=FakeWorld(), log=lines.append)
    code = run_and_report(t, FakeWorld())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return t, code, rows


def _figures(rows):
    return [{k: v for k, v in r.items() if k not in ("time", "timestamp", "images_per_s")} for r in rows]


def test_no_read_back_between_the_intervals_and_the_same_figures(
        host_build_dir, monkeypatch, tmp_path):
    emulated_trainer_env(monkeypatch, host_build_dir)
    config = _config()
    reads = ReadBacks(monkeypatch)
    t, code, rows = _run(config, tmp_path / "deferred", monkeypatch=monkeypatch)
    assert code == 0 and t.graphs.watch == "loss_watch"
    assert t.graphs.graph.ops["loss_watch"].op_type == "LossWatch"
    checks = {3, 5, 7, 11}  # done = 4, 6 (checkpoint), 8, 12 (display, checkpoint, end)
    assert set(reads.by_iter) <= checks, reads.by_iter
    assert all(reads.by_iter.get(i) for i in (3, 7)), reads.by_iter  # the counter counts
    # the same run reading the loss every iteration (as the CPU does)
    every = ReadBacks(monkeypatch)
    t2, code2, rows2 = _run(config, tmp_path / "every", defer=False, monkeypatch=monkeypatch)
    assert code2 == 0 and t2.graphs.watch is None
    assert set(every.by_iter) == set(range(12))  # the old path: a read every iteration
    assert _figures(rows) == _figures(rows2)
    assert [r["iter"] for r in rows if r["phase"] == "train"] == [4, 8, 12]
    # and close to the CPU (the emulated kernels round differently)
    _, code3, rows3 = _run(_config(device=-1), tmp_path / "cpu",
                           monkeypatch=monkeypatch)
    assert code3 == 0
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in rows3],
                               rtol=1e-5)


@pytest.mark.parametrize("k", [7, 8])
def test_divergence_at_k_is_reported_as_k_and_latest_stays_finite(
        host_build_dir, monkeypatch, tmp_path, capsys, k):
    """The loss of iteration k (counted from 1) is NaN, and its gradient too:
    k is between two read-backs (7: the run goes on to 8 on the device, then
    stops) or at one (8)."""
    from purine_mpi.job.checkpoint_file import load_checkpoint
    from purine_mpi.train.trainer import Trainer
    emulated_trainer_env(monkeypatch, host_build_dir)
    now = {}
    real_step = Trainer.step

    def step(trainer, it):
        now["it"] = it
        return real_step(trainer, it)

    monkeypatch.setattr(Trainer, "step", step)
    for op_type in ("SoftmaxLoss", "SoftmaxLossGrad"):
        cls = get_kernel_class(op_type)

        def run(self, ins, outs, _real=cls.run):
            _real(self, ins, outs)
            if now.get("it") == k - 1:
                outs[0][...] = np.nan
        monkeypatch.setattr(cls, "run", run)
    # the NaN is injected by the kernels' host code at one iteration, which a
    # CUDA-graph replay does not run (it replays the device work alone): the
    # eager stream dispatcher, whose loss watch and read-backs are the same
    config = _config(max_iter=20, display=5, interval=2, cuda_graph=False)
    results = {}
    for defer in (False, True):
        out = tmp_path / f"defer{defer}"
        _, code, rows = _run(config, out, defer=defer, monkeypatch=monkeypatch)
        err = capsys.readouterr().err
        assert code == 3, err
        assert f"at iteration {k}; latest.h5 stays the last finite checkpoint " \
               f"(iteration {k - 1 - (k - 1) % 2})" in err, err
        latest = load_checkpoint(str(out / "latest.h5"))
        assert latest.iteration == k - 1 - (k - 1) % 2
        assert all(np.isfinite(v).all() for v in latest.params.values())
        assert not any((out / f"ckpt_{i}.h5").exists() for i in range(k, 21))
        results[defer] = _figures(rows)
    assert results[True] == results[False]


def test_all_finite_finds_a_nan_or_an_infinity_in_one_read_back(device):
    """The weight check before a checkpoint on a GPU (train/divergence.py):
    our kernel, not CuPy's reductions; the largest float32 values are finite
    (their squares fit float64), one NaN or infinity anywhere is not."""
    from purine_mpi.gpu import kernels
    big = device.to_device(np.full((3, 5), 3.4e38, np.float32))
    ramp = device.to_device(np.arange(7, dtype=np.float32))
    assert kernels.all_finite([big, ramp]) and kernels.all_finite([])
    for bad in (np.nan, np.inf, -np.inf):
        c = np.arange(1000, dtype=np.float32)
        c[777] = bad
        assert not kernels.all_finite([big, device.to_device(c), ramp]), bad
    assert device.launched.count("grad_sumsq") == 2 + 3 * 3


def _rows_with_test_data(out, device, cuda_graph):
    """The tiny net with a test split: display every 3 iterations, a test
    pass every 2 (between two display rows, on the one at 6, and the end's
    at 9), a checkpoint at 6 and at the end."""
    from purine_mpi.train.trainer import Trainer, run_and_report
    raw = tiny_raw(device=device, checkpoint={"interval": 6, "keep": 5}, cuda_graph=cuda_graph)
    raw["data"]["test"] = {"source": "synthetic", "shape": [3, 8, 8], "classes": 5,
                           "num_samples": 16, "batch_size": 8}
    raw["solver"].update(max_iter=9, display=3, test_interval=2)
    t = Trainer(make_job(validate_config(raw, check_files=False)), str(out), world=FakeWorld(),
                log=lambda line: None)
    assert run_and_report(t, FakeWorld()) == 0
    assert (t.graphs.watch is not None) == (device >= 0)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "train"], [r for r in rows if r["phase"] == "test"]


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_every_train_row_with_test_passes_and_checkpoints_is_the_cpu_one(
        host_build_dir, monkeypatch, tmp_path, cuda_graph):
    """Every ``train`` row of a run with a test split (whose test graph has
    its own dispatcher on the same GPU) is the CPU run's: the iteration, the
    loss over the whole display window and the lr of the row's iteration,
    also where a test pass, a checkpoint or the end falls on the row. (Until
    the emulated trainer's dispatchers shared one simulated device, the
    training graph's streams were made on the test graph's device, its
    drain waited for nothing, and each row was read while iterations were
    still queued: a window sum short of its last losses divided by all of
    them, and an earlier iteration's lr.)"""
    emulated_trainer_env(monkeypatch, host_build_dir)
    train, test = _rows_with_test_data(tmp_path / "gpu", 0, cuda_graph)
    cpu_train, cpu_test = _rows_with_test_data(tmp_path / "cpu", -1, cuda_graph)
    assert [r["iter"] for r in train] == [r["iter"] for r in cpu_train] == [3, 6, 9]
    assert [r["iter"] for r in test] == [r["iter"] for r in cpu_test] == [2, 4, 6, 8, 9]
    # float32 rounding: the emulated kernels sum in another order than the CPU's
    np.testing.assert_allclose([r["loss"] for r in train], [r["loss"] for r in cpu_train],
                               rtol=1e-6)
    np.testing.assert_allclose([r["lr"] for r in train], [r["lr"] for r in cpu_train],
                               rtol=1e-7)
    np.testing.assert_allclose([r["loss"] for r in test], [r["loss"] for r in cpu_test],
                               rtol=1e-6)


def test_the_runtimes_of_one_gpu_share_its_simulated_device(host_build_dir, monkeypatch):
    """The emulator itself: a stream made while another runtime's device is
    the active one is refused (its synchronisation would wait for nothing);
    runtimes given one device make their streams there."""
    from tests.emulated_gpu import SimulatedRuntime, use_emulated_cupy
    use_emulated_cupy(monkeypatch, host_build_dir)
    first = SimulatedRuntime(4)
    SimulatedRuntime(4)  # a fresh device, now the active one
    with pytest.raises(RuntimeError, match="another simulated device"):
        first.stream(0, 0)
    a = SimulatedRuntime(4)
    b = SimulatedRuntime(4, device=a.device)
    assert a.stream(0, 0).device is b.stream(0, 1).device is a.device
