"""Data larger than memory: an HDF5 split that does not fit the memory budget
is read batch by batch from its chunked datasets, in the same sample order;
uint8 pixels stay uint8 until the transform step."""
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import ConfigError, UserError
from purine_mpi.job.config import validate_config
from purine_mpi.data.sources import EpochOrder, HDF5Source, batch_indices, memory_budget
from tests.conftest import PYTHON, REPO, cli_env, write_config_file


def _write(path, data, labels, chunk_rows=7):
    with h5py.File(path, "w") as f:
        g = f.create_group("train")
        g.create_dataset("data", data=data, chunks=(chunk_rows,) + data.shape[1:],
                         compression="gzip")
        g.create_dataset("label", data=labels)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_on_demand_reads_equal_the_in_memory_source(tmp_path, dtype):
    rng = np.random.default_rng(0)
    n = 53
    data = (rng.integers(0, 256, (n, 2, 5, 4)) if dtype == np.uint8
            else rng.standard_normal((n, 2, 5, 4))).astype(dtype)
    labels = rng.integers(0, 7, n).astype(np.int64)
    path = str(tmp_path / "d.h5")
    _write(path, data, labels)
    memory = HDF5Source(path, "train", in_memory=True)
    disk = HDF5Source(path, "train", in_memory=False)
    assert memory.data is not None and disk.data is None
    order = EpochOrder(n, shuffle=True, seed=3)
    for it in range(12):  # several epochs; 2 ranks x 16 (windows wrap over epochs)
        for rank in range(2):
            idx = batch_indices(it, rank, 2, 16, order)
            a, b = memory.gather(idx), disk.gather(idx)
            assert a[0].dtype == b[0].dtype == dtype
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])
            np.testing.assert_array_equal(b[0], data[idx])
    # repeated indices in one batch (a batch larger than the split)
    idx = np.array([5, 1, 5, 52, 1])
    np.testing.assert_array_equal(disk.gather(idx)[0], data[idx])


def test_auto_follows_the_memory_budget(tmp_path, monkeypatch):
    data = np.zeros((10, 1, 4, 4), np.uint8)
    path = str(tmp_path / "d.h5")
    _write(path, data, np.zeros(10, np.int64))
    monkeypatch.setenv("PURINE_DATA_MEMORY_MB", "0.0005")  # 524 bytes < 10*16*4
    assert memory_budget() == 524
    assert HDF5Source(path, "train").data is None
    monkeypatch.setenv("PURINE_DATA_MEMORY_MB", "1")
    assert HDF5Source(path, "train").data is not None


def test_non_finite_values_are_found_at_start_up(tmp_path):
    """A float split kept on disk is scanned once when opened (issue 21):
    the error comes before any training, not from the batch that holds it."""
    data = np.ones((20, 1, 2, 2), np.float32)
    data[13, 0, 1, 0] = np.nan
    path = str(tmp_path / "d.h5")
    _write(path, data, np.zeros(20, np.int64))
    with pytest.raises(UserError, match=r"'/train/data' holds non-finite.*index 13"):
        HDF5Source(path, "train", in_memory=False)
    disk = HDF5Source.__new__(HDF5Source)  # a block at a time: the index is the file's
    disk.path, disk.where = path, "/train/"
    import h5py
    with h5py.File(path, "r") as f, pytest.raises(UserError, match="index 13"):
        disk._scan_finite(f["train/data"], block_bytes=5 * 16)


def test_in_memory_key_is_checked(tmp_path):
    cfg = {"name": "x", "data": {"train": {"source": "hdf5", "path": "x.h5", "batch_size": 2,
                                           "in_memory": "sometimes"}},
           "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc",
                    "num_output": 2}]}
    with pytest.raises(ConfigError, match="data.train.in_memory"):
        validate_config(cfg, check_files=False)


LIMITED = """
import resource, sys
limit = int(sys.argv[1]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from purine_mpi.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_split_larger_than_the_memory_limit_trains(tmp_path):
    """614 MB of uint8 pixels (2.4 GB as float32), compressible so the file
    is small, trained under a 500 MB address-space limit: the loader reads
    each batch from the file. Forcing it into memory fails under the same
    limit, so the limit is real."""
    n = 200_000
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("train")
        d = g.create_dataset("data", (n, 3, 32, 32), np.uint8, chunks=(21, 3, 32, 32),
                             compression="gzip", compression_opts=1, shuffle=True)
        for s in range(0, n, 20_000):
            v = (np.arange(s, s + 20_000) % 251).astype(np.uint8)
            d[s:s + 20_000] = np.broadcast_to(v[:, None, None, None], (20_000, 3, 32, 32))
        g.create_dataset("label", data=(np.arange(n) % 10).astype(np.int64))
    assert n * 3 * 32 * 32 > 500 << 20
    cfg = write_config_file(tmp_path, {
        "name": "big", "seed": 1,
        "data": {"train": {"source": "hdf5", "path": str(path), "split": "train",
                           "batch_size": 64, "shuffle": True, "scale": 0.004}},
        "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 10},
                {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"],
                 "top": "loss"}],
        "solver": {"base_lr": 0.01, "max_iter": 20, "display": 10}})

    def run(*extra):
        return subprocess.run([PYTHON, "-c", LIMITED, "500", "train", cfg, "--out",
                               tmp_path / f"run{len(extra)}", *extra], cwd=REPO,
                              env=cli_env(), capture_output=True, text=True, timeout=300)
    res = run()
    assert res.returncode == 0, res.stderr
    assert "iter 20/20" in res.stdout
    forced = run("--set", "data.train.in_memory=true")
    assert forced.returncode != 0 and "MemoryError" in forced.stderr + forced.stdout
