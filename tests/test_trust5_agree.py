"""Issue 42: every rank starts from the same inputs (defect 2), the solver
state of a resumed checkpoint is checked as its weights are and a diverged
run names only a finite checkpoint as finite (defect 4), and weights saved
by a config that gives a layer another meaning are refused (a doubt: a
4-head GPT checkpoint in a 2-head config)."""
import os
import shutil
import subprocess

import h5py
import numpy as np
import pytest

from tests.conftest import (MPIEXEC, PYTHON, REPO, FakeWorld, cli_env, make_job,
                            run_cli_args, small_net_config, train_here,
                            write_config_file)
from tests.gpt_nets import gpt_config, text_h5

AGREE = "Every rank must start from the same inputs"


def _mpmd(*argvs, timeout=240):
    """``mpiexec -n 1 A : -n 1 B ...``: rank r runs ``argvs[r]`` (a list:
    the words after ``python -m purine_mpi``, or a full command when it
    starts with a path)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cmd = [MPIEXEC]
    for i, argv in enumerate(argvs):
        words = list(map(str, argv))
        if not os.path.isabs(words[0]):
            words = [PYTHON, "-m", "purine_mpi", *words]
        cmd += ([":"] if i else []) + ["-n", "1", *words]
    return subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, digits_h5):
    """A 4-iteration digits job with a checkpoint every 2 and a finished
    one-rank run of it: (config, run folder)."""
    d = tmp_path_factory.mktemp("agree")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=4, display=2)
    cfg["checkpoint"] = {"interval": 2}
    config = write_config_file(d, cfg)
    return config, train_here(config, d / "run")  # in this process (conftest.train_here)


def _one_line_exit_2(res, *words):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


# ---------------------------------------------------------------- defect 2
@pytest.mark.mpi
def test_init_given_to_one_rank_only_exits_2_naming_the_rank(tiny, tmp_path):
    config, run = tiny
    weights = str(run / "latest.h5")
    res = _mpmd(["train", config, "--out", tmp_path / "a", "--init", weights],
                ["train", config, "--out", tmp_path / "a"])
    line = _one_line_exit_2(res, "rank 1's --init differs from rank 0's", weights,
                            "rank 1: none", AGREE)
    assert "sha256" in line
    # the same file under another name (a copy): the content agrees, the run goes on
    copy = tmp_path / "copy.h5"
    shutil.copyfile(weights, copy)
    res = _mpmd(["train", config, "--out", tmp_path / "b", "--init", weights],
                ["train", config, "--out", tmp_path / "b", "--init", copy])
    assert res.returncode == 0, res.stderr


@pytest.mark.mpi
def test_init_skip_or_resume_on_one_rank_only_exits_2(tiny, tmp_path):
    config, run = tiny
    out = tmp_path / "r"
    shutil.copytree(run, out)
    res = _mpmd(["train", config, "--out", out, "--iters", 6, "--resume", "auto"],
                ["train", config, "--out", out, "--iters", 6])
    _one_line_exit_2(res, "rank 1's --resume differs from rank 0's",
                     f"'{out / 'latest.h5'}' at iteration 4", "rank 1: none")
    # an explicit checkpoint of another iteration on one rank
    res = _mpmd(["train", config, "--out", out, "--iters", 6, "--resume", out / "ckpt_2.h5"],
                ["train", config, "--out", out, "--iters", 6, "--resume", out / "ckpt_4.h5"])
    _one_line_exit_2(res, "rank 1's --resume differs", "at iteration 2", "at iteration 4")
    weights = str(run / "latest.h5")
    res = _mpmd(["train", config, "--out", tmp_path / "s", "--init", weights,
                 "--init-skip", "fc1"],
                ["train", config, "--out", tmp_path / "s", "--init", weights])
    _one_line_exit_2(res, "rank 1's --init-skip differs", "rank 0: fc1; rank 1: none")


def _can_bind_mount(tmp_path):
    a, b = tmp_path / "m_a", tmp_path / "m_b"
    a.write_text("a")
    b.write_text("b")
    try:
        res = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {b} {a} && cat {a}"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0 and res.stdout == "b"


@pytest.mark.mpi
def test_a_data_file_that_differs_on_one_rank_exits_2(tiny, digits_h5, tmp_path):
    """The same path holds another file on rank 1 (another host's copy: here
    a bind mount in rank 1's own mount namespace), of the same size."""
    if not _can_bind_mount(tmp_path) or shutil.which("unshare") is None:
        pytest.skip("needs unshare -m and mount --bind (a private mount namespace)")
    config, _ = tiny
    other = tmp_path / "other.h5"
    shutil.copyfile(digits_h5, other)
    with h5py.File(other, "r") as f:  # one byte of the training images, in place
        images = f["train/data"].id
        offset = images.get_offset() if images.get_offset() is not None else \
            images.get_chunk_info(0).byte_offset
    with open(other, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    assert os.path.getsize(other) == os.path.getsize(digits_h5)
    out = tmp_path / "d"
    inner = " ".join(["exec", PYTHON, "-m", "purine_mpi", "train", config, "--out", str(out)])
    res = _mpmd(["train", config, "--out", out],
                [shutil.which("unshare"), "-m", "sh", "-c",
                 f"mount --bind {other} {digits_h5} && {inner}"])
    _one_line_exit_2(res, "rank 1's data.train.path differs from rank 0's", digits_h5,
                     f"{os.path.getsize(digits_h5)} bytes", "(also differ: data.test.path)")


def test_a_data_file_is_known_by_its_bytes_not_its_name(tmp_path, monkeypatch):
    from purine_mpi.job import inputs
    a, b, c = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    a.write_bytes(data.tobytes())
    b.write_bytes(data.tobytes())
    data[1000] ^= 1
    c.write_bytes(data.tobytes())
    key = lambda p: inputs.data_file_digest(str(p))[0]  # noqa: E731
    assert key(a) == key(b) != key(c)
    assert inputs.data_file_digest(str(tmp_path / "none"))[0] == "not found"
    # above WHOLE_UP_TO: a bounded sample, which the first block's change is in
    monkeypatch.setattr(inputs, "WHOLE_UP_TO", 1 << 16)
    assert key(a) == key(b) != key(c)
    assert "sha256 of 64 blocks" in inputs.data_file_digest(str(a))[1]


# ---------------------------------------------------------------- defect 4
def _edit(src, dst, dataset, value):
    """A copy of checkpoint ``src`` whose ``dataset`` gets ``value`` at its
    first element (rewritten with its Fletcher-32 checksum, as ours are)."""
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        v = f[dataset][...]
        v.flat[0] = value
        del f[dataset]
        f.create_dataset(dataset, data=v, fletcher32=True)
    return dst


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_nan_in_the_solver_state_is_refused_on_resume(tiny, tmp_path, value):
    config, run = tiny
    bad = _edit(run / "latest.h5", tmp_path / "bad.h5", "solver/fc1/weight/momentum", value)
    res = run_cli_args("train", config, "--out", tmp_path / "o", "--resume", bad,
                       "--iters", 8)
    assert res.returncode == 3, (res.returncode, res.stderr)
    assert "blob 'fc1/weight.momentum' (1 of" in res.stderr, res.stderr
    assert "stays the last finite checkpoint" not in res.stderr
    assert not (tmp_path / "o" / "ckpt_8.h5").exists()


def test_a_diverged_run_names_the_checkpoint_it_resumed_not_a_latest_h5(tiny, tmp_path):
    """Resumed from another folder's checkpoint and diverged before writing
    one: the finite checkpoint is the one resumed; this folder's latest.h5
    is not it (here it holds NaN, left by an earlier run)."""
    config, run = tiny
    out = tmp_path / "o"
    out.mkdir()
    _edit(run / "latest.h5", out / "latest.h5", "params/fc1/weight", np.nan)
    res = run_cli_args("train", config, "--out", out, "--resume", run / "ckpt_2.h5",
                       "--iters", 8, "--set", "solver.base_lr=1e30")
    assert res.returncode == 3, (res.returncode, res.stderr)
    assert f"'{run / 'ckpt_2.h5'}' stays the last finite checkpoint (iteration 2)" \
        in res.stderr, res.stderr
    assert "latest.h5 stays" not in res.stderr


def test_no_checkpoint_follows_a_non_finite_solver_state(digits_h5, tmp_path):
    """The check before a checkpoint reads the solver state too (an Adam
    second moment can overflow to inf while the weights stay finite)."""
    from purine_mpi.graph.solver_graph import state_name
    from purine_mpi.train.divergence import DivergenceWatch
    from purine_mpi.train.trainer import Trainer
    t = Trainer(make_job(small_net_config(digits_h5)), str(tmp_path), world=FakeWorld(),
                log=lambda m: None)
    try:
        assert DivergenceWatch.params_finite(t)
        t.ws[state_name("fc1/bias", "momentum")][3] = np.inf
        assert not DivergenceWatch.params_finite(t)
    finally:
        t.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_the_finite_check_holds_no_array_sized_temporary(dtype):
    """base/backend.all_finite (the check before a checkpoint or a test
    pass, and of the weights a file gives) finds a NaN, an inf or a -inf
    wherever it is, in a strided view too, and holds no array-sized
    temporary (tracemalloc's peak): ``isfinite(a).all()`` held a byte an
    element, a 4096 x 1024 fc weight's 4 MiB at a parameter-server worker's
    check after its last iteration, its peak, 1.8 MiB above its loop's."""
    import tracemalloc

    from purine_mpi.base.backend import all_finite
    a = np.ones(1 << 20, dtype)
    tracemalloc.start()
    try:
        assert all_finite(a)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < a.size // 16, peak
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 12345, a.size - 1):
            b = a.copy()
            b[at] = bad
            assert not all_finite(b), (bad, at)
            assert all_finite(b[1 - at % 2::2]) and not all_finite(b[at % 2::2]), (bad, at)
    assert all_finite(np.zeros(0, dtype)) and all_finite(np.arange(5))


class _Arrays:
    """A workspace's ``arrays`` and ``ws[name]``."""

    def __init__(self, arrays):
        self.arrays = arrays

    def __getitem__(self, name):
        return self.arrays[name]


def test_a_zero_ranks_solver_state_shard_is_checked_too(digits_h5):
    """Scheme sharded (stages 1 and 3, rank 0 of 2, from the composed
    graph): the check before a checkpoint reads the rank's flat shard of
    each bucket's optimizer state (named by no parameter: it was skipped,
    and an inf momentum went into the checkpoint)."""
    from types import SimpleNamespace

    from purine_mpi.tools.graph import composed
    from purine_mpi.train.divergence import DivergenceWatch
    for shard in (1, 3):
        cfg = small_net_config(digits_h5, parallel={"scheme": "sharded", "shard": shard,
                                                    "bucket_mb": 0.001})
        job = make_job(cfg)
        g, comp = composed(job, 2, 0)
        states = [b for b in g.blobs if ".shard." in b]
        assert states
        ws = _Arrays({b: np.zeros(g.blobs[b].shape, np.float32)
                      for b in g.blobs if g.blobs[b].shape is not None})
        loop = SimpleNamespace(job=job, ws=ws, train=SimpleNamespace(drain=lambda: None),
                               graphs=SimpleNamespace(graph=g, composition=comp, params=[
                                   b for b in g.blobs if g.blobs[b].kind == "param"]))
        assert DivergenceWatch.params_finite(loop)
        ws.arrays[states[-1]][0] = np.inf
        assert not DivergenceWatch.params_finite(loop), (shard, states[-1])


# ------------------------------------------------- a doubt: 4 heads into 2
@pytest.fixture(scope="module")
def four_heads(tmp_path_factory):
    d = tmp_path_factory.mktemp("heads")
    data = text_h5(d)
    config = write_config_file(d, gpt_config(data, layers=1, heads=4, iters=2), "h4.yaml")
    return d, data, train_here(config, d / "run4")  # in this process (conftest.train_here)


def test_a_4_head_checkpoint_is_refused_by_a_2_head_config(four_heads):
    d, data, run = four_heads
    cfg = gpt_config(data, layers=1, heads=2, iters=4)
    two = write_config_file(d, cfg, "h2.yaml")
    want = ("layer 'b0_attn' was saved with num_heads 4, this config gives num_heads 2",
            "same shapes")
    for args in (["train", two, "--out", d / "i2", "--init", run / "latest.h5"],
                 ["train", two, "--out", d / "r2", "--resume", run / "latest.h5"],
                 ["test", two, "--weights", run],
                 ["generate", two, "--weights", run, "--prompt", "def ", "--tokens", 2]):
        _one_line_exit_2(run_cli_args(*args), str(run), *want)
    # --init-skip of that layer: its weights are not loaded, nothing to refuse
    res = run_cli_args("train", two, "--out", d / "s2", "--init", run / "latest.h5",
                       "--init-skip", "b0_attn")
    assert res.returncode == 0, res.stderr


def test_a_change_that_keeps_the_weights_meaning_still_loads(four_heads):
    d, data, run = four_heads
    cfg = gpt_config(data, layers=1, heads=4, iters=4, solver="sgd")  # another solver
    cfg["solver"]["base_lr"] = 0.001
    cfg["net"][3]["attn_dropout"] = 0.1  # a training key of the attention layer
    other = write_config_file(d, cfg, "h4b.yaml")
    res = run_cli_args("train", other, "--out", d / "ok", "--init", run / "latest.h5")
    assert res.returncode == 0, res.stderr
    causal = gpt_config(data, layers=1, heads=4, iters=4)
    causal["net"][3]["causal"] = False
    res = run_cli_args("train", write_config_file(d, causal, "h4c.yaml"), "--out", d / "c",
                       "--init", run / "latest.h5")
    _one_line_exit_2(res, "layer 'b0_attn' was saved with causal True, this config gives "
                          "causal False")
