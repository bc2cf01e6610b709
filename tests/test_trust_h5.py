"""Issue 32 "Trust", the HDF5 reading cases: HDF5 inputs are self-contained
or refused (4, 5), a checkpoint held by another process is not "corrupt"
(8), ``inspect`` reads in bounded memory (11b), a data file declaring 10^9
samples is refused clearly (18b). Each test failed on 6dff0b5."""
import json
import os
import resource
import shutil
import subprocess

import h5py
import numpy as np
import pytest

from tests.conftest import PYTHON, REPO, cli_env, run_cli_args, write_config_file


@pytest.fixture(scope="module")
def run(small_run):
    """A finished run with ckpt_10.h5, ckpt_20.h5 and latest.h5 (conftest's, shared)."""
    return small_run


def _copy_run(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run["out"], out)
    return out


def _rewrite(path, name, make):
    """Replace dataset ``name`` of ``path`` by what ``make(f, name, value)`` puts there."""
    with h5py.File(path, "a") as f:
        value = f[name][...]
        del f[name]
        make(f, name, value)
    return value


def _fails_clearly(res, *words):
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    assert "Traceback" not in text, text
    for word in words:
        assert word in text, (word, text)


def _tiny_data_config(tmp_path, data_path, **spec):
    cfg = {"name": "t", "seed": 1,
           "data": {"train": dict({"source": "hdf5", "path": str(data_path), "batch_size": 8},
                                  **spec)},
           "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc", "num_output": 4},
                   {"type": "softmax_loss", "name": "l", "bottom": ["fc", "label"],
                    "top": "l"}],
           "solver": {"base_lr": 0.01, "max_iter": 2}}
    return write_config_file(tmp_path, cfg, "tiny.yaml")


def _samples(n=32):
    rng = np.random.default_rng(0)
    return (rng.integers(0, 255, (n, 1, 4, 4), dtype=np.uint8),
            rng.integers(0, 4, n).astype(np.int64))


# ------------------------------------------------------------------ case 4
def test_case4_checkpoint_external_storage_refused_by_test_and_init(run, tmp_path):
    """Case 4: weights whose /params/fc1/bias is raw bytes of another file
    (external storage): test --weights and train --init exit 2 naming the
    dataset and the file (before: accepted, exit 0, the other file's bytes
    used as weights)."""
    other = tmp_path / "other.bin"
    other.write_bytes(os.urandom(4096))
    bad = tmp_path / "bad.h5"
    shutil.copy(run["out"] / "latest.h5", bad)
    _rewrite(bad, "params/fc1/bias", lambda f, name, v: f.create_dataset(
        name, shape=v.shape, dtype=v.dtype, external=[(str(other), 0, v.nbytes)]))
    res = run_cli_args("test", run["path"], "--weights", bad)
    _fails_clearly(res, "/params/fc1/bias", str(other), "external")
    res = run_cli_args("train", run["path"], "--init", bad, "--out", tmp_path / "init")
    _fails_clearly(res, "/params/fc1/bias", str(other), "external")


def test_case4_resume_external_link_refused(run, tmp_path):
    """Case 4: --resume of a checkpoint whose weight is an external link to
    another file exits 2 naming the link and the file (before: the link was
    followed and the run resumed, exit 0)."""
    out = _copy_run(run, tmp_path)
    target = tmp_path / "elsewhere.h5"
    ckpt = out / "ckpt_20.h5"
    with h5py.File(ckpt, "r") as f:
        value = f["params/fc1/weight"][...]
    with h5py.File(target, "w") as g:
        g.create_dataset("w", data=value, fletcher32=True)
    _rewrite(ckpt, "params/fc1/weight",
             lambda f, name, v: f.__setitem__(name, h5py.ExternalLink(str(target), "/w")))
    res = run_cli_args("train", run["path"], "--out", out, "--resume", ckpt,
                       "--set", "solver.max_iter=22")
    _fails_clearly(res, "/params/fc1/weight", str(target), "external link")
    assert "resumed from" not in res.stdout + res.stderr


def test_case4_data_external_storage_needs_opt_in(tmp_path):
    """Case 4: a data file whose 'data' is stored in another file trains only
    with the data spec's 'external: true' (before: exit 0 without it), and
    then only when that file is large enough."""
    data, label = _samples()
    raw = tmp_path / "pixels.raw"
    raw.write_bytes(data.tobytes())
    path = tmp_path / "ext.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("data", shape=data.shape, dtype=np.uint8,
                         external=[(str(raw), 0, data.nbytes)])
        f["label"] = label
    cfg = _tiny_data_config(tmp_path, path)
    _fails_clearly(run_cli_args("train", cfg, "--out", tmp_path / "a"),
                   str(path), "'/data'", str(raw), "external: true")
    res = run_cli_args("train", cfg, "--out", tmp_path / "b", "--set", "data.train.external=true")
    assert res.returncode == 0, res.stdout + res.stderr
    raw.write_bytes(data.tobytes()[:100])  # shorter than the dataset needs
    _fails_clearly(run_cli_args("train", cfg, "--out", tmp_path / "c", "--set",
                                "data.train.external=true"), str(path), str(raw), "100 bytes")


# ------------------------------------------------------------------ case 5
def _virtual(f, name, shape, dtype, source_file, source_name):
    layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
    layout[...] = h5py.VirtualSource(str(source_file), source_name, shape=shape)
    f.create_virtual_dataset(name, layout)


def test_case5_virtual_dataset_missing_source(run, tmp_path):
    """Case 5: a virtual dataset whose source file is missing reads as zeros;
    now data without 'external: true' is refused as virtual, with it as a
    missing source, and weights so built are refused (before: all exit 0,
    training and testing on zeros)."""
    data, label = _samples()
    src = tmp_path / "src.h5"
    with h5py.File(src, "w") as f:
        f["d"] = data
    path = tmp_path / "vds.h5"
    with h5py.File(path, "w") as f:
        _virtual(f, "data", data.shape, np.uint8, src, "d")
        f["label"] = label
    cfg = _tiny_data_config(tmp_path, path)
    os.remove(src)
    _fails_clearly(run_cli_args("train", cfg, "--out", tmp_path / "a"),
                   str(path), "'/data'", "virtual dataset", "external: true")
    _fails_clearly(run_cli_args("train", cfg, "--out", tmp_path / "b", "--set",
                                "data.train.external=true"), str(path), str(src), "does not exist")
    with h5py.File(src, "w") as f:
        f["d"] = data
    res = run_cli_args("train", cfg, "--out", tmp_path / "ok", "--set", "data.train.external=true")
    assert res.returncode == 0, res.stdout + res.stderr  # the source is there: allowed
    weights = tmp_path / "w.h5"
    shutil.copy(run["out"] / "latest.h5", weights)
    gone = tmp_path / "gone.h5"
    _rewrite(weights, "params/fc1/weight",
             lambda f, name, v: _virtual(f, name, v.shape, v.dtype, gone, "w"))
    _fails_clearly(run_cli_args("test", run["path"], "--weights", weights),
                   "/params/fc1/weight", "virtual dataset", str(gone))


# ------------------------------------------------------------------ case 8
def test_case8_held_latest_is_not_corrupt_and_not_skipped(run, tmp_path):
    """Case 8: latest.h5 held open for writing by another process: --resume
    auto exits 2 saying it is held by that process (its pid), not corrupt,
    and does not resume from an older checkpoint (before: "truncated or
    corrupt", resumed from ckpt_10, exit 0)."""
    out = _copy_run(run, tmp_path)
    holder = subprocess.Popen(
        [PYTHON, "-c", "import sys, time, h5py\nf = h5py.File(sys.argv[1], 'a')\n"
         "print('open', flush=True)\ntime.sleep(120)", str(out / "latest.h5")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        res = run_cli_args("train", run["path"], "--out", out, "--resume", "auto",
                           "--set", "solver.max_iter=30")
    finally:
        holder.kill()
        holder.wait()
    _fails_clearly(res, "latest.h5", "held open by another process", f"pid {holder.pid}")
    text = res.stdout + res.stderr
    assert "corrupt" not in text and "resumed from" not in text, text


# ----------------------------------------------------------------- case 11
def _limit_memory(nbytes):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
    return limit


def test_case11b_inspect_huge_declared_dataset_in_bounded_memory(tmp_path):
    """Case 11 (second half): inspect of a small gzip file declaring 2**31
    float32 (8 GiB) runs under a 1.5 GB address-space limit and gives the
    statistics of every value, fill included, and --diff against a like file
(before: MemoryError traceback)."""
    n = 2 ** 31
    path, other = tmp_path / "bomb.h5", tmp_path / "other.h5"
    for name, last in ((path, 6.0), (other, 2.0)):
        with h5py.File(name, "w") as f:
            d = f.create_dataset("x", shape=(n,), dtype=np.float32, chunks=(1 << 20,),
                                 compression="gzip")
            d[:4] = [1.0, 2.0, -3.0, 4.0]
            d[n - 2:] = [5.0, last]
            d[1 << 21:(1 << 21) + (1 << 20)] = 0.0  # one whole chunk written (zeros)
        assert os.path.getsize(name) < 1 << 20
    res = subprocess.run([PYTHON, "-m", "purine_mpi", "inspect", str(path), "--json",
                          "--diff", str(other)], cwd=REPO, env=cli_env(), capture_output=True,
                         text=True, timeout=120, preexec_fn=_limit_memory(1500 << 20))
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    (entry,) = report["datasets"]
    (row,) = report["diff"]["datasets"]
    assert row["max_abs_diff"] == 4.0
    assert row["rel_l2_diff"] == pytest.approx(4.0 / np.sqrt(1 + 4 + 9 + 16 + 25 + 36), rel=1e-12)
    values = np.array([1.0, 2.0, -3.0, 4.0, 5.0, 6.0])
    mean = values.sum() / n
    std = np.sqrt(((values - mean) ** 2).sum() / n + (n - len(values)) * mean ** 2 / n)
    assert entry["shape"] == [n] and entry["min"] == -3.0 and entry["max"] == 6.0
    assert entry["mean"] == pytest.approx(mean, rel=1e-9)
    assert entry["std"] == pytest.approx(std, rel=1e-6)
    assert entry["l2"] == pytest.approx(np.sqrt((values ** 2).sum()), rel=1e-12)


# ----------------------------------------------------------------- case 18
def test_case18b_data_file_declaring_a_billion_samples(tmp_path):
    """Case 18 (second half): a data file declaring 10**9 samples (a few KB
    on disk) exits 2 naming the file, the label dataset and
    PURINE_DATA_MEMORY_MB (before: MemoryError, exit 1, naming neither)."""
    path = tmp_path / "huge.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("data", shape=(10 ** 9, 1, 4, 4), dtype=np.uint8,
                         chunks=(4096, 1, 4, 4), compression="gzip")
        f.create_dataset("label", shape=(10 ** 9,), dtype=np.int64, chunks=(1 << 16,),
                         compression="gzip")
    cfg = _tiny_data_config(tmp_path, path)
    env = cli_env()
    env.pop("PURINE_DATA_MEMORY_MB", None)
    res = subprocess.run([PYTHON, "-m", "purine_mpi", "train", cfg, "--out", str(tmp_path / "r")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                         preexec_fn=_limit_memory(3 << 30))
    _fails_clearly(res, str(path), "'/label'", "PURINE_DATA_MEMORY_MB")
