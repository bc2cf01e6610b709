"""Training: equivalence with PyTorch, digits end to end, bit-exact resume,
--init, and checkpoints that survive SIGKILL."""
import copy
import json
import os
import shutil
import signal
import subprocess
import time

import h5py
import numpy as np
import pytest

from purine_mpi.job.checkpoint_file import load_checkpoint
from purine_mpi.job.config import resolve_config
from purine_mpi.train.trainer import Trainer

from .conftest import (PYTHON, REPO, FakeWorld, cli_env, make_job, small_net_config,
                       write_config_file)

torch = pytest.importorskip("torch")
F = torch.nn.functional


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def h5_arrays(path, groups=("params", "solver")):
    out = {}
    with h5py.File(path, "r") as f:
        for g in groups:
            if g not in f:
                continue

            def visit(name, obj, g=g):
                if isinstance(obj, h5py.Dataset):
                    out[f"{g}/{name}"] = obj[...]
            f[g].visititems(visit)
    return out


# ------------------------------------------------ equivalence with PyTorch
def torch_equiv_config(digits_h5):
    return small_net_config(digits_h5, net=[
        {"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1",
         "num_output": 4, "kernel": 3, "pad": 1},
        {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
        {"type": "pool", "name": "pool1", "bottom": "conv1", "top": "pool1",
         "pool": "max", "kernel": 2, "stride": 2},
        {"type": "lrn", "name": "norm1", "bottom": "pool1", "top": "norm1",
         "local_size": 3, "alpha": 0.3, "beta": 0.75, "k": 1.5},
        {"type": "conv", "name": "conv2", "bottom": "norm1", "top": "conv2",
         "num_output": 6, "kernel": 3, "pad": 1, "group": 2},
        {"type": "relu", "name": "relu2", "bottom": "conv2", "top": "conv2"},
        {"type": "pool", "name": "pool2", "bottom": "conv2", "top": "pool2",
         "pool": "ave", "kernel": 2, "stride": 2},
        {"type": "fc", "name": "fc1", "bottom": "pool2", "top": "fc1", "num_output": 12,
         "bias_filler": {"type": "uniform", "min": -0.1, "max": 0.1}},
        {"type": "tanh", "name": "tanh1", "bottom": "fc1", "top": "fc1"},
        {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 10},
        {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss"},
    ])


def torch_forward(p, x):
    y = F.conv2d(x, p["conv1/weight"], p["conv1/bias"], padding=1)
    y = F.max_pool2d(F.relu(y), 2, 2)
    y = F.local_response_norm(y, 3, alpha=0.3, beta=0.75, k=1.5)
    y = F.conv2d(y, p["conv2/weight"], p["conv2/bias"], padding=1, groups=2)
    y = F.avg_pool2d(F.relu(y), 2, 2)
    y = torch.tanh(F.linear(y.flatten(1), p["fc1/weight"], p["fc1/bias"]))
    return F.linear(y, p["fc2/weight"], p["fc2/bias"])


def make_trainer(config, out_dir, dispatcher="serial", **kw):
    return Trainer(make_job(config), str(out_dir), world=FakeWorld(), dispatcher=dispatcher,
                   log=lambda msg: None, **kw)


def test_training_matches_pytorch_sgd(digits_h5, tmp_path):
    config = resolve_config(torch_equiv_config(digits_h5))
    lr, mu, wd, iters = 0.05, 0.9, 5e-4, 6
    t = make_trainer(config, tmp_path)
    try:
        names = sorted(t.graphs.params)
        assert names == sorted(f"{l}/{k}" for l in ("conv1", "conv2", "fc1", "fc2")
                               for k in ("weight", "bias"))
        initial = {n: np.array(t.ws[n]) for n in names}
        params = {n: torch.tensor(initial[n], requires_grad=True) for n in names}
        opt = torch.optim.SGD([params[n] for n in names], lr=lr, momentum=mu,
                              weight_decay=wd)
        for it in range(iters):
            t.ws["iter"][...] = it
            t.train.run(it)
            x = torch.tensor(np.array(t.ws["data"]))
            labels = torch.tensor(np.array(t.ws["label"]))
            assert x.shape == (16, 1, 8, 8) and labels.dtype == torch.int64
            ours = float(t.ws["loss"])
            opt.zero_grad()
            loss = F.cross_entropy(torch_forward(params, x), labels)
            loss.backward()
            opt.step()
            assert ours == pytest.approx(loss.item(), rel=1e-5), f"iteration {it}"
            assert float(t.ws["lr"]) == pytest.approx(lr)
        for n in names:
            ref = params[n].detach().numpy()
            scale = float(np.abs(ref).max())
            np.testing.assert_allclose(np.array(t.ws[n]), ref, rtol=1e-4, atol=1e-5 * scale,
                                       err_msg=n)
            # the weights moved: the comparison is not trivially true
            assert np.abs(ref - initial[n]).max() > 100 * 1e-5 * scale, n
    finally:
        t.close()


def test_event_and_serial_dispatchers_train_identically(digits_h5, tmp_path):
    config = resolve_config(torch_equiv_config(digits_h5))
    results = []
    for kind in ("serial", "event"):
        t = make_trainer(config, tmp_path / kind, dispatcher=kind)
        try:
            losses = []
            for it in range(4):
                t.ws["iter"][...] = it
                t.train.run(it)
                losses.append(float(t.ws["loss"]))
            results.append((losses, {p: np.array(t.ws[p]) for p in t.graphs.params}))
        finally:
            t.close()
    (l1, p1), (l2, p2) = results
    assert l1 == l2
    for n in p1:
        assert np.array_equal(p1[n], p2[n]), n


# --------------------------------------------------------- digits end to end
TRAIN_KEYS = {"phase", "iter", "loss", "lr", "images_per_s", "time"}
TEST_KEYS = {"phase", "iter", "loss", "accuracy"}


def test_digits_lenet_end_to_end(digits_h5, tmp_path):
    out = tmp_path / "run"
    res = subprocess.run(
        [PYTHON, "-m", "purine_mpi", "train", "jobs/digits_lenet.yaml",
         "--set", f"data.train.path={digits_h5}", "--set", f"data.test.path={digits_h5}",
         "--out", str(out)], cwd=REPO, env=cli_env(), capture_output=True, text=True,
        timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    recs = read_metrics(out)
    train = [r for r in recs if r["phase"] == "train"]
    test = [r for r in recs if r["phase"] == "test"]
    assert [r["iter"] for r in train] == list(range(100, 901, 100))
    assert [r["iter"] for r in test] == [300, 600, 900]
    for r in train:
        assert TRAIN_KEYS <= set(r), r
        assert np.isfinite(r["loss"]) and r["images_per_s"] > 0 and r["time"] > 0
    for r in test:
        assert TEST_KEYS <= set(r), r
        assert 0.0 <= r["accuracy"] <= 1.0
    # step policy: gamma 0.1 every 600 iterations
    assert train[0]["lr"] == pytest.approx(0.05) and train[-1]["lr"] == pytest.approx(0.005)
    assert train[-1]["loss"] < train[0]["loss"]
    assert test[-1]["accuracy"] >= 0.97, test[-1]
    # the config that ran, fully resolved, loads back
    import yaml
    with open(out / "config.yaml") as f:
        ran = yaml.safe_load(f)
    assert ran["data"]["train"]["path"] == digits_h5 and ran["solver"]["max_iter"] == 900
    assert ran["name"] == "digits_lenet"
    for it in (300, 600, 900):
        assert (out / f"ckpt_{it}.h5").exists()
    ck = load_checkpoint(out / "latest.h5")
    assert ck.iteration == 900 and ck.attrs["format"] == "purine_mpi.checkpoint"
    assert set(ck.params) == {f"{l}/{k}" for l in ("conv1", "conv2", "fc1", "fc2")
                              for k in ("weight", "bias")}
    assert ck.params["conv2/weight"].shape == (32, 16, 3, 3)
    assert set(ck.solver) == set(ck.params)
    # latest.h5 is the same checkpoint as the newest ckpt file
    a, b = h5_arrays(out / "latest.h5"), h5_arrays(out / "ckpt_900.h5")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert "final" in res.stdout


# ------------------------------------------------------------------- resume
def resume_config(digits_h5):
    return small_net_config(
        digits_h5,
        net=[
            {"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1",
             "num_output": 4, "kernel": 3, "pad": 1},
            {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
            {"type": "pool", "name": "pool1", "bottom": "conv1", "top": "pool1",
             "pool": "max", "kernel": 2, "stride": 2},
            {"type": "fc", "name": "fc1", "bottom": "pool1", "top": "fc1", "num_output": 32},
            {"type": "relu", "name": "relu2", "bottom": "fc1", "top": "fc1"},
            {"type": "dropout", "name": "drop1", "bottom": "fc1", "top": "fc1",
             "ratio": 0.5},
            {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 10},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"],
             "top": "loss"},
            {"type": "accuracy", "name": "acc", "bottom": ["fc2", "label"], "top": "acc",
             "phase": "test"},
        ],
        solver={"base_lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4,
                "lr_policy": "step", "gamma": 0.5, "stepsize": 70, "max_iter": 200,
                "display": 10, "test_interval": 0},
        checkpoint={"interval": 100, "keep": 5})


def train_cli(*args, timeout=120):
    res = subprocess.run([PYTHON, "-m", "purine_mpi", "train", *map(str, args)], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr
    return res


@pytest.fixture(scope="module")
def resume_runs(digits_h5, tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    cfg = write_config_file(base, resume_config(digits_h5))
    straight, split, by_path = base / "straight", base / "split", base / "by_path"
    train_cli(cfg, "--out", straight)
    train_cli(cfg, "--out", split, "--iters", 100)
    assert load_checkpoint(split / "latest.h5").iteration == 100
    train_cli(cfg, "--out", split, "--resume", "auto")
    train_cli(cfg, "--out", by_path, "--resume", split / "ckpt_100.h5")
    return {"cfg": cfg, "straight": straight, "split": split, "by_path": by_path}


def test_resume_is_bit_exact(resume_runs):
    straight = h5_arrays(resume_runs["straight"] / "latest.h5")
    assert any(k.startswith("solver/") for k in straight)
    half = h5_arrays(resume_runs["straight"] / "ckpt_100.h5")
    for run in ("split", "by_path"):
        other = h5_arrays(resume_runs[run] / "latest.h5")
        assert other.keys() == straight.keys()
        for k in straight:
            assert np.array_equal(straight[k], other[k]), f"{run}: {k}"
        assert load_checkpoint(resume_runs[run] / "latest.h5").iteration == 200
    # the weights did move between the checkpoints
    assert not np.array_equal(half["params/fc1/weight"], straight["params/fc1/weight"])


def test_resume_continues_the_loss_curve_exactly(resume_runs):
    def train_losses(run):
        return {r["iter"]: r["loss"] for r in read_metrics(resume_runs[run])
                if r["phase"] == "train"}
    a, b = train_losses("straight"), train_losses("split")
    assert sorted(a) == list(range(10, 201, 10))
    assert sorted(b) == list(range(10, 201, 10))  # metrics appended, nothing repeated
    for it in range(10, 201, 10):
        assert a[it] == b[it], it
    c = train_losses("by_path")
    assert sorted(c) == list(range(110, 201, 10))
    assert all(c[it] == a[it] for it in c)
    test_a = [r for r in read_metrics(resume_runs["straight"]) if r["phase"] == "test"]
    test_b = [r for r in read_metrics(resume_runs["split"]) if r["phase"] == "test"]
    assert test_a[-1]["iter"] == test_b[-1]["iter"] == 200
    assert test_a[-1]["accuracy"] == test_b[-1]["accuracy"]


def test_checkpoint_holds_data_state_and_no_rng(resume_runs):
    """The state the bit-exact resume depends on is in the checkpoint: the
    data reader's position. Dropout draws its masks from a counter-based
    generator keyed by seed, op and iteration (purine_mpi/base/philox.py), so it
    has no random state to save, and the resume is bit-exact anyway."""
    ck = load_checkpoint(resume_runs["split"] / "ckpt_100.h5")
    assert "ranks" in ck.state
    kernels = ck.state["ranks"]["0"]
    assert "drop1.fwd" not in kernels
    assert kernels["data"]["state"]["position"] == 100


def test_init_loads_params(resume_runs, tmp_path):
    src = resume_runs["straight"] / "latest.h5"
    out = tmp_path / "init"
    train_cli(resume_runs["cfg"], "--out", out, "--init", src, "--iters", 0)
    got, want = h5_arrays(out / "latest.h5", ("params",)), h5_arrays(src, ("params",))
    assert got.keys() == want.keys()
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    # without --init the same command starts from the fillers
    out2 = tmp_path / "noinit"
    train_cli(resume_runs["cfg"], "--out", out2, "--iters", 0)
    fresh = h5_arrays(out2 / "latest.h5", ("params",))
    assert not np.array_equal(fresh["params/fc1/weight"], want["params/fc1/weight"])
    # test --weights evaluates exactly what training evaluated at the end
    res = subprocess.run([PYTHON, "-m", "purine_mpi", "test", resume_runs["cfg"],
                          "--weights", src, "--out", tmp_path / "t"], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    final = [r for r in read_metrics(resume_runs["straight"]) if r["phase"] == "test"][-1]
    assert result["accuracy"] == pytest.approx(final["accuracy"], abs=1e-6)
    assert result["loss"] == pytest.approx(final["loss"], rel=1e-5)


def test_resume_auto_without_latest_uses_newest_ckpt(resume_runs, tmp_path):
    out = tmp_path / "no_latest"
    out.mkdir()
    shutil.copy(resume_runs["split"] / "ckpt_100.h5", out / "ckpt_100.h5")
    train_cli(resume_runs["cfg"], "--out", out, "--resume", "auto")
    # it resumed (a fresh start would also end at the same weights)
    assert [r["iter"] for r in read_metrics(out) if r["phase"] == "train"] == \
        list(range(110, 201, 10))
    got, want = h5_arrays(out / "latest.h5"), h5_arrays(resume_runs["straight"] / "latest.h5")
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------- killed run
def test_sigkill_never_leaves_a_partial_latest(digits_h5, tmp_path):
    cfg = copy.deepcopy(resume_config(digits_h5))
    cfg["solver"].update(max_iter=1000000, display=1)
    cfg["checkpoint"] = {"interval": 2, "keep": 2}
    path = write_config_file(tmp_path, cfg)
    out = tmp_path / "run"
    latest = out / "latest.h5"
    expected = {f"{l}/{k}" for l in ("conv1", "fc1", "fc2") for k in ("weight", "bias")}
    seen_iters = []
    for attempt, delay in enumerate((0.13, 0.31, 0.07)):
        args = [PYTHON, "-m", "purine_mpi", "train", path, "--out", str(out)]
        if attempt:
            args += ["--resume", "auto"]
        proc = subprocess.Popen(args, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            before = latest.stat().st_mtime_ns if latest.exists() else None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                if latest.exists() and latest.stat().st_mtime_ns != before:
                    break
                time.sleep(0.01)
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(delay)  # checkpoints every 2 iterations: likely mid-write
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        ck = load_checkpoint(latest)  # opens, and is complete
        assert set(ck.params) == expected and set(ck.solver) == expected
        assert ck.params["fc2/weight"].shape == (10, 32)
        assert ck.iteration % 2 == 0 and ck.iteration > 0
        assert ck.state["ranks"]["0"]["data"]["state"]["position"] == ck.iteration
        for name in os.listdir(out):  # every file under a final name is whole too
            if name.startswith("ckpt_") and name.endswith(".h5"):
                assert load_checkpoint(out / name).iteration == int(name[5:-3])
        seen_iters.append(ck.iteration)
        # a resumed run drops what the killed one logged after its checkpoint:
        # every logged iteration appears once, in order
        with open(out / "metrics.jsonl") as f:
            lines = f.read().splitlines()
        recs = []
        for i, line in enumerate(lines):
            try:
                recs.append(json.loads(line))
            except ValueError:
                assert i == len(lines) - 1, "only the last line may be cut short"
        iters = [r["iter"] for r in recs if r["phase"] == "train"]
        assert iters == list(range(1, len(iters) + 1))
    # each run resumed from the previous one's latest and got further
    assert seen_iters == sorted(seen_iters) and seen_iters[0] < seen_iters[-1]
