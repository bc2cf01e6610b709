"""What a run on the GPU reports is what the CPU run of the same job reports
(tests/emulated_gpu: the CUDA kernels compiled for the host, the stream
dispatcher on a simulated device, the trainer's own GPU path).

Every figure a run reports -- the train rows' loss and lr, the test rows'
loss and accuracy, the ``final`` line, the best checkpoints kept, early
stopping, the checkpoints' weights, solver state, /state groups and
attributes -- on the emulated device against the CPU, within float32
rounding: the emulated kernels sum in other orders than NumPy (the softmax
sums, the GEMMs' blocks, the loss watch's window on the device), so a
figure differs in its last bits, and the float64 figures kept in /state
(early stopping's best) carry that float32 difference. A CUDA-graph run is
the eager one bit for bit (a capture replays the same kernels), with the lr
schedule stepping, test passes and checkpoints between captured iterations.
A checkpoint resumes on the other device to the uninterrupted run's next
figures; ``test`` and ``predict`` of a GPU-trained checkpoint on the CPU
give the GPU's figures."""
import contextlib
import io
import json

import h5py
import numpy as np
import pytest

from purine_mpi.job.config import validate_config
from tests.conftest import FakeWorld, make_job
from tests.emulated_gpu import compare, emulated_trainer_env, reporting_raw
from tests.emulated_gpu.fixtures import device  # noqa: F401  (a fixture)

#: the attributes that are the run's own, not a figure (its id, wall time,
#: config, whose ``device:`` differs) and the checksum of its /state group
#: (whose float figures differ in their last bits)
OWN = ("run_id", "elapsed", "config", "sha256")


def _job(device, cuda_graph=False, **solver):
    return make_job(validate_config(reporting_raw(device, cuda_graph, **solver),
                                    check_files=False))


def _train(out, device, cuda_graph=False, resume=None, job=None, **solver):
    """-> (exit status, metrics.jsonl's rows without timings, the final line)"""
    from purine_mpi.train.trainer import Trainer, run_and_report
    t = Trainer(job or _job(device, cuda_graph, **solver), str(out), world=FakeWorld(),
                resume=resume, log=lambda line: None)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = run_and_report(t, FakeWorld())
    assert (t.graphs.watch is not None) == (device >= 0)  # the GPU's own path: its loss watch
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = [line for line in printed.getvalue().splitlines() if line.startswith("final ")]
    return code, _figures(rows), json.loads(final[-1][6:])


def _figures(rows):
    """metrics.jsonl's rows without the wall-clock ones (time, speed)."""
    clock = ("time", "timestamp", "images_per_s", "tokens_per_s")
    return [{k: v for k, v in r.items() if k not in clock} for r in rows]


def _h5(path):
    """{path or path@attr: value} of every dataset and attribute but ``OWN``;
    /state's JSON datasets parsed."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            for k, v in obj.attrs.items():
                if k not in OWN:
                    out[f"{name}@{k}"] = v
            if isinstance(obj, h5py.Dataset):
                v = obj[()]
                out[name] = json.loads(v) if name.startswith("state/") and \
                    isinstance(v, bytes) and v[:1] in (b"{", b"[") else v
        f.visititems(visit)
        out.update({f"@{k}": v for k, v in f.attrs.items() if k not in OWN})
    return out


def _close(got, want, where, rtol, atol=1e-7):
    """Equal, floats (also inside /state's JSON) within ``rtol``."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for k in want:
            _close(got[k], want[k], f"{where}.{k}", rtol, atol)
    elif isinstance(want, (list, tuple)) and not isinstance(want, np.ndarray):
        assert len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{where}[{i}]", rtol, atol)
    elif isinstance(want, (float, np.floating)) or (
            isinstance(want, np.ndarray) and want.dtype.kind == "f"):
        g, w = np.asarray(got), np.asarray(want)
        assert g.shape == w.shape and g.dtype == w.dtype, (where, g.shape, w.shape, g.dtype)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=where)
    else:
        assert np.array_equal(got, want) if isinstance(want, np.ndarray) else got == want, \
            (where, got, want)


def _same_files(gpu, cpu, rtol, atol):
    """The run folders hold the same checkpoints, each with the same
    datasets and attributes, equal within ``rtol``/``atol``."""
    names = sorted(p.name for p in cpu.glob("*.h5"))
    assert names == sorted(p.name for p in gpu.glob("*.h5"))
    for name in names:
        want, got = _h5(cpu / name), _h5(gpu / name)
        assert set(got) == set(want), (name, set(got) ^ set(want))
        for k in want:
            _close(got[k], want[k], f"{name}:{k}", rtol, atol)
    return names


def test_softmax_loss_past_87_nats_is_the_cpu_ops(device):
    """A position whose label's probability is below FLT_MIN (a logit
    ~100 below the largest): the fused kernel's loss is log-sum-exp minus
    the label's shifted logit, as the CPU op (and torch's cross_entropy)
    computes it. (It clamped the probability at FLT_MIN, Caffe's
    -log(max(p, FLT_MIN)): each such position's loss stopped at 87.34 nats,
    while the gradient, prob - onehot, was not clamped.)"""
    x = np.array([[0.0, 120.0, -3.0, 5.0], [1.0, 2.0, 3.0, 4.0],
                  [300.0, 0.0, 0.0, 0.0]], np.float32)
    label = np.array([0, 3, 1], np.int64)
    for dtype in (np.float32, np.float64):
        cpu, got = compare(device, "SoftmaxLoss", {}, [x.astype(dtype), label],
                           ["softmax_loss_forward"], dtype)
        x64 = x.astype(np.float64)
        top = x64.max(axis=1)
        want = np.mean(np.log(np.exp(x64 - top[:, None]).sum(axis=1)) + top
                       - x64[np.arange(3), label])  # (120 + 0.44 + 300) / 3 nats
        np.testing.assert_allclose(float(cpu[0]), want, rtol=1e-6)
        np.testing.assert_allclose(float(got[0]), want, rtol=1e-6)


@pytest.mark.parametrize("solver", [
    {},  # sgd with momentum, step lr (halved every 2 iterations)
    # rmsprop at base_lr 0.1: test losses of hundreds of nats (positions past 87.3)
    {"type": "rmsprop", "momentum": 0, "lr_policy": "multistep", "stepvalues": [3, 7]},
], ids=["sgd", "rmsprop"])
def test_every_reported_figure_and_checkpoint_is_the_cpus(
        host_build_dir, monkeypatch, tmp_path, solver):
    """The emulated device, eager and captured into CUDA graphs, against the
    CPU: metrics.jsonl's every row, the final line, the best checkpoints
    kept, early stopping's state, every checkpoint's datasets and
    attributes. The lr steps at 2, 4, ... (inside a capture's run of
    iterations), test passes fall between display rows, and checkpoints at
    4 and 8 fall between captured iterations."""
    emulated_trainer_env(monkeypatch, host_build_dir)
    code, cpu_rows, cpu_final = _train(tmp_path / "cpu", -1, **solver)
    assert code == 0
    runs = {cg: _train(tmp_path / f"gpu{int(cg)}", 0, cg, **solver) for cg in (False, True)}
    assert runs[False] == runs[True]  # the capture replays the eager run bit for bit
    code, rows, final = runs[True]
    assert code == 0
    assert [(r["phase"], r["iter"]) for r in rows] == [(r["phase"], r["iter"]) for r in cpu_rows]
    assert [r["iter"] for r in rows if r["phase"] == "test"] == [2, 4, 6, 8, 10]
    _close(rows, cpu_rows, "metrics.jsonl", rtol=2e-6)
    _close(final, cpu_final, "final", rtol=2e-6)
    # rmsprop's step, rate * g / sqrt(h), is about the rate whatever g's
    # size: a gradient near 0 whose float32 bits differ moves its weight by
    # 1e-5 more or less (weights of size 1 after 10 steps at base_lr 0.1)
    names = _same_files(tmp_path / "gpu1", tmp_path / "cpu", rtol=1e-5,
                        atol=1e-4 if solver else 1e-7)
    assert "best_4.h5" in names or solver
    # and the captured run's checkpoints are the eager run's, bit for bit
    assert _same_files(tmp_path / "gpu1", tmp_path / "gpu0", rtol=0, atol=0) == names


def test_early_stop_and_best_on_the_gpu_are_the_cpus(host_build_dir, monkeypatch, tmp_path):
    """Early stopping firing (accuracy not improving for 2 passes after the
    test pass at iteration 0) and the best checkpoints it leaves."""
    emulated_trainer_env(monkeypatch, host_build_dir)
    stop = {"early_stop": {"metric": "accuracy", "patience": 2}, "test_initialization": True}
    cpu = _train(tmp_path / "cpu", -1, **stop)
    gpu = _train(tmp_path / "gpu", 0, True, **stop)
    assert cpu[2]["early_stop"] == gpu[2]["early_stop"] == 4
    _close(gpu, cpu, "run", rtol=2e-6)
    assert _same_files(tmp_path / "gpu", tmp_path / "cpu", 1e-5, 1e-7) == [
        "best_0.h5", "best_4.h5", "ckpt_4.h5", "latest.h5"]


def test_a_checkpoint_moves_between_the_gpu_and_the_cpu(host_build_dir, monkeypatch, tmp_path):
    """A GPU run's checkpoint at 4 resumed on the CPU gives the uninterrupted
    CPU run's rows from 5 on, and a CPU checkpoint resumed on the GPU the
    GPU run's; ``test`` (Trainer.evaluate) and ``predict`` of the GPU's last
    checkpoint on the CPU give the GPU's figures and outputs."""
    from purine_mpi.tools.predict import predict_split
    from purine_mpi.train.trainer import Trainer
    emulated_trainer_env(monkeypatch, host_build_dir)
    full = {d: _train(tmp_path / f"full{d}", d, True) for d in (0, -1)}
    for src, dst in ((0, -1), (-1, 0)):
        code, rows, final = _train(tmp_path / f"to{dst}", dst, True,
                                   resume=str(tmp_path / f"full{src}" / "ckpt_4.h5"))
        assert code == 0
        _close(rows, [r for r in full[dst][1] if r["iter"] > 4], f"resume {src} -> {dst}",
               rtol=2e-6)
        _close(final, full[dst][2], f"final {src} -> {dst}", rtol=2e-6)
    weights = str(tmp_path / "full0" / "latest.h5")
    figures, outputs = {}, {}
    for d in (0, -1):
        t = Trainer(_job(d), str(tmp_path / f"eval{d}"), init=weights, log=lambda line: None)
        try:
            figures[d] = t.evaluate()
        finally:
            t.close()
        predict_split(_job(d), str(tmp_path / f"pred{d}.h5"), weights, log=lambda line: None)
        with h5py.File(tmp_path / f"pred{d}.h5") as f:
            outputs[d] = {"fc1": f["outputs/fc1"][()], "label": f["label"][()]}
    _close(figures[-1], figures[0], "test on the CPU", rtol=2e-6)
    _close(figures[0], {k: full[0][2][k] for k in figures[0]}, "test on the GPU", rtol=2e-6)
    assert outputs[-1]["fc1"].shape == (20, 5)
    _close(outputs[-1], outputs[0], "predict on the CPU", rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_two_ranks_of_data_parallelism_on_the_gpu_report_the_cpus(host_build_dir, tmp_path):
    """2 ranks, each on its own emulated GPU (captured iterations, buckets
    staged through the host), against the same 2 ranks on the CPU
    (tests/mpi_scripts/trust_gpu_dp.py): every row, the final line, every
    checkpoint. The test pass of 20 samples is one batch of 2 x 8 and one
    padded one; the gradients are averaged by the allreduce on both."""
    from tests.mpi_scripts.launch import run_mpi
    proc, _ = run_mpi("trust_gpu_dp.py", 2, host_build_dir, tmp_path, timeout=240)
    assert proc.stdout.count("OK trust_gpu_dp") == 2, proc.stdout + proc.stderr
    finals = [json.loads(line[6:]) for line in proc.stdout.splitlines()
              if line.startswith("final ")]
    assert len(finals) == 2 and finals[0]["samples"] == 20, proc.stdout
    _close(finals[0], finals[1], "final", rtol=2e-6)
    rows = {d: [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text()
                .splitlines()] for d in ("gpu", "cpu")}
    gpu, cpu = _figures(rows["gpu"]), _figures(rows["cpu"])
    assert [r["iter"] for r in gpu if r["phase"] == "test"] == [2, 4, 6, 8, 10]
    _close(gpu, cpu, "metrics.jsonl", rtol=2e-6)
    _same_files(tmp_path / "gpu", tmp_path / "cpu", rtol=1e-5, atol=1e-7)


def test_a_tiny_gpt_on_the_gpu_reports_the_cpus(host_build_dir, monkeypatch, tmp_path):
    """A 1-block GPT (the token-level loss over (N, T, V) logits, AdamW,
    warmup then cosine), captured: its train and validation rows, final
    line and checkpoints (AdamW's moments, the Adam step count in /state)
    against the CPU's."""
    from tests.gpt_nets import gpt_config, text_h5
    emulated_trainer_env(monkeypatch, host_build_dir)
    tokens = text_h5(tmp_path)
    runs = {}
    for device in (0, -1):
        raw = gpt_config(tokens, layers=1, width=16, heads=2, length=8, batch=2, iters=6)
        raw.update(device=device, cuda_graph=device >= 0, checkpoint={"interval": 3, "keep": 3})
        raw["solver"].update(lr_policy="cosine", warmup_iters=2, display=2, test_interval=3)
        job = make_job(validate_config(raw, check_files=False))
        runs[device] = _train(tmp_path / f"d{device}", device, job=job)
        assert runs[device][0] == 0
    assert [r["iter"] for r in runs[0][1] if r["phase"] == "test"] == [0, 3, 6]
    _close(runs[0], runs[-1], "run", rtol=2e-6)
    assert _same_files(tmp_path / "d0", tmp_path / "d-1", rtol=1e-4, atol=2e-5) == [
        "ckpt_3.h5", "ckpt_6.h5", "latest.h5"]
