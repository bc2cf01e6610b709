"""``predict``: per-sample outputs of a split in file order, sharded over the
ranks like evaluation, written to HDF5 by rank 0."""
import json

import h5py
import numpy as np
import pytest

from tests.conftest import run_cli_args, run_mpi_cli


@pytest.fixture(scope="module")
def trained(digits_h5, tmp_path_factory):
    out = tmp_path_factory.mktemp("predict") / "run"
    data = [f"data.train.path={digits_h5}", f"data.test.path={digits_h5}",
            "data.test.batch_size=60"]  # 360 test samples: 6 whole batches
    args = [a for d in data for a in ("--set", d)]
    res = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", out, "--iters", "60", *args)
    assert res.returncode == 0, res.stderr
    return out, args


def _read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in ("outputs/fc2", "label", "index")}, dict(f.attrs)


def test_predictions_give_the_test_accuracy_in_file_order(trained, tmp_path, digits_h5):
    out, args = trained
    res = run_cli_args("predict", "jobs/digits_lenet.yaml", "--weights", out / "latest.h5",
                       "--out", tmp_path / "p.h5", *args)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["samples"] == 360
    rows, attrs = _read(tmp_path / "p.h5")
    assert rows["outputs/fc2"].shape == (360, 10) and attrs["blobs"] == "fc2"
    with h5py.File(digits_h5, "r") as f:
        np.testing.assert_array_equal(rows["label"], f["test/label"][()])  # file order
    np.testing.assert_array_equal(rows["index"], np.arange(360))
    test = run_cli_args("test", "jobs/digits_lenet.yaml", "--weights", out / "latest.h5", *args)
    accuracy = json.loads(test.stdout.strip().splitlines()[-1])["accuracy"]
    mine = float(np.mean(rows["outputs/fc2"].argmax(1) == rows["label"]))
    assert abs(mine - accuracy) < 1e-6, (mine, accuracy)


@pytest.mark.mpi
def test_two_ranks_write_the_same_rows(trained, tmp_path):
    out, args = trained
    one = run_cli_args("predict", "jobs/digits_lenet.yaml", "--weights", out / "latest.h5",
                       "--out", tmp_path / "one.h5", *args)
    two = run_mpi_cli(2, "predict", "jobs/digits_lenet.yaml", "--weights", out / "latest.h5",
                      "--out", tmp_path / "two.h5", *args)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    a, _ = _read(tmp_path / "one.h5")
    b, _ = _read(tmp_path / "two.h5")
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_a_blob_the_test_phase_does_not_compute_is_named(trained, tmp_path):
    out, args = trained
    res = run_cli_args("predict", "jobs/digits_lenet.yaml", "--weights", out / "latest.h5",
                       "--out", tmp_path / "p.h5", "--blob", "nonesuch", *args)
    assert res.returncode == 2 and "nonesuch" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "p.h5").exists()
