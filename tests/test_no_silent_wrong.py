"""No silent wrong answer, and every user error is exit 2 with one message
(issue 12): bad values in data files, a net that disagrees with its labels,
weights files that lack parameters, edited or damaged checkpoints, litter of
killed writers, non-finite numbers in metrics and configs."""
import json
import math
import os
import re
import subprocess

import h5py
import numpy as np
import pytest

from purine_mpi.job.metrics import write_row

from .conftest import (PYTHON, REPO, cli_env, run_cli_args, run_cli_here,
                       small_net_config, write_config_file)
from .test_cli import assert_user_error


@pytest.fixture(scope="module")
def trained(small_run):
    """A 20-iteration run with checkpoints at 10 and 20 (conftest's, shared)."""
    return small_run


def _copy_data(src, dst, mutate):
    with h5py.File(src, "r") as f, h5py.File(dst, "w") as g:
        for split in ("train", "test"):
            data, label = f[f"{split}/data"][...], f[f"{split}/label"][...]
            mutate(split, data, label)
            g[f"{split}/data"], g[f"{split}/label"] = data, label
    return str(dst)


def test_nan_pixel_in_data_is_a_user_error(digits_h5, tmp_path):
    def mutate(split, data, label):
        if split == "train":
            data[7, 0, 3, 3] = np.nan
    bad = _copy_data(digits_h5, tmp_path / "nan.h5", mutate)
    path = write_config_file(tmp_path, small_net_config(bad))
    assert_user_error(run_cli_args("train", path, "--out", tmp_path / "o"), "nan.h5",
                      "/train/data", "index 7")


def test_label_out_of_range_is_found_at_load(digits_h5, tmp_path):
    def mutate(split, data, label):
        if split == "test":
            label[5] = 12
    bad = _copy_data(digits_h5, tmp_path / "lab.h5", mutate)
    path = write_config_file(tmp_path, small_net_config(bad))
    assert_user_error(run_cli_args("train", path, "--out", tmp_path / "o"), "lab.h5",
                      "/test/label", "12", "[0, 10)")


def test_num_output_below_classes_is_one_message(digits_h5, tmp_path):
    cfg = small_net_config(digits_h5)
    cfg["net"][3]["num_output"] = 5
    path = write_config_file(tmp_path, cfg)
    text = assert_user_error(run_cli_args("train", path, "--out", tmp_path / "o"),
                             "digits.h5", "/train/label", "[0, 5)")
    assert text.count("error:") == 1


def test_metrics_write_null_for_non_finite(tmp_path):
    path = tmp_path / "m.jsonl"
    with open(path, "w") as f:
        write_row(f, {"phase": "train", "iter": 3, "loss": math.nan, "lr": math.inf,
                      "time": 1.5})
    rec = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(c))
    assert rec == {"phase": "train", "iter": 3, "loss": None, "lr": None, "time": 1.5}


def _other_net(trained):
    cfg = dict(trained["cfg"], net=[dict(layer) for layer in trained["cfg"]["net"]])
    cfg["net"][3] = dict(cfg["net"][3], name="classifier")
    cfg["net"][4] = dict(cfg["net"][4], bottom=["classifier", "label"])
    cfg["net"][3]["top"] = "classifier"
    cfg["net"][5] = dict(cfg["net"][5], bottom=["classifier", "label"])
    return cfg


def test_weights_without_the_nets_params_exit_2(trained):
    other = write_config_file(trained["dir"], _other_net(trained), "other.yaml")
    ckpt = trained["out"] / "latest.h5"
    assert_user_error(run_cli_args("test", other, "--weights", ckpt, "--out",
                                   trained["dir"] / "t"),
                      "latest.h5", "classifier/weight", "classifier/bias",
                      "the weights belong to another net")  # test takes no --init-skip
    assert_user_error(run_cli_args("train", other, "--init", ckpt, "--out",
                                   trained["dir"] / "i"),
                      "latest.h5", "classifier/weight", "--init-skip")


def test_init_skip_fine_tunes_a_changed_layer(trained):
    cfg = _other_net(trained)
    cfg["solver"] = dict(cfg["solver"], max_iter=1)
    other = write_config_file(trained["dir"], cfg, "other1.yaml")
    ckpt = trained["out"] / "latest.h5"
    out = trained["dir"] / "ft"
    res = run_cli_args("train", other, "--init", ckpt, "--init-skip", "classifier",
                       "--out", out, "--set", "solver.base_lr=0")
    assert res.returncode == 0, res.stderr
    with h5py.File(ckpt, "r") as a, h5py.File(out / "latest.h5", "r") as b:
        for name in ("conv1/weight", "conv1/bias"):  # loaded, then lr 0 keeps them
            np.testing.assert_array_equal(a["params"][name][...], b["params"][name][...])
        assert "classifier/weight" in b["params"]
    assert_user_error(run_cli_args("train", other, "--init", ckpt, "--init-skip", "nope",
                                   "--out", out, "--force"), "--init-skip", "nope")


def test_edited_state_fails_its_checksum(trained, tmp_path):
    edited = tmp_path / "edited.h5"
    edited.write_bytes((trained["out"] / "latest.h5").read_bytes())
    with h5py.File(edited, "r+") as f:  # /state/ranks: JSON text per rank and kernel
        ranks = json.loads(f["state/ranks"].asstr()[()])
        ranks["0"]["data"]["state"]["position"] += 3
        f["state/ranks"][()] = json.dumps(ranks)
    assert_user_error(run_cli_args("train", trained["path"], "--resume", edited, "--out",
                                   tmp_path / "r"), "edited.h5", "/state", "checksum")


def test_temp_files_of_killed_writers_are_removed(trained, tmp_path):
    from purine_mpi.job.run_checkpoints import remove_stale_temp_files
    out = tmp_path / "litter"
    out.mkdir()
    dead = out / "ckpt_171.h5.tmp.999999999"
    dead.write_bytes(b"partial")
    mine = out / f"latest.h5.tmp.{os.getppid()}"  # a live writer's: kept
    mine.write_bytes(b"partial")
    assert remove_stale_temp_files(str(out)) == [str(dead)]
    assert not dead.exists() and mine.exists()
    dead.write_bytes(b"partial")
    res = run_cli_args("train", trained["path"], "--out", out, "--iters", "1")
    assert res.returncode == 0, res.stderr
    assert not dead.exists()


@pytest.mark.parametrize("damage", ["garbage", "heap"])
def test_resume_auto_falls_back_from_a_corrupt_latest(trained, tmp_path, damage):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("ckpt_10.h5", "ckpt_20.h5"):
        (out / name).write_bytes((trained["out"] / name).read_bytes())
    raw = bytearray((trained["out"] / "latest.h5").read_bytes())
    if damage == "garbage":
        raw[len(raw) // 3:] = b"\0" * (len(raw) - len(raw) // 3)
    else:  # the global heap holding variable-length strings (JSON values)
        at = raw.find(b"GCOL")
        assert at > 0
        raw[at + 16:at + 64] = b"\xff" * 48
    (out / "latest.h5").write_bytes(bytes(raw))
    res = run_cli_args("train", trained["path"], "--out", out, "--resume", "auto",
                       "--iters", "22")
    assert res.returncode == 0, res.stderr
    assert "latest.h5" in res.stdout and "ckpt_20.h5" in res.stdout, res.stdout
    with h5py.File(out / "latest.h5", "r") as f:
        assert f.attrs["iteration"] == 22
    # named directly, the damaged file is exit 2 with one message
    (out / "bad.h5").write_bytes(bytes(raw))
    assert_user_error(run_cli_args("train", trained["path"], "--out", tmp_path / "x",
                                   "--resume", out / "bad.h5"), "bad.h5", "corrupt")


def test_binary_config_and_non_finite_numbers(trained, tmp_path):
    binary = tmp_path / "cfg.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    assert_user_error(run_cli_here("train", binary), "cfg.yaml", "UTF-8")
    for value in (".inf", ".nan", "-.inf"):
        assert_user_error(run_cli_here("graph", trained["path"], "--set",
                                       f"solver.base_lr={value}"),
                          "solver.base_lr", "finite")


def _diverging(trained, tmp_path):
    cfg = dict(trained["cfg"], solver=dict(trained["cfg"]["solver"], base_lr=1000.0,
                                           max_iter=200, display=5),
               checkpoint={"interval": 2, "keep": 100})
    cfg["data"] = {"train": cfg["data"]["train"]}
    return write_config_file(tmp_path, cfg, "diverge.yaml")


def _check_diverged(res, out):
    assert res.returncode == 3, (res.returncode, res.stderr)
    m = re.search(r"non-finite .* at iteration (\d+); latest.h5 stays the last finite "
                  r"checkpoint \(iteration (\d+)\)", res.stderr)
    assert m, res.stderr
    assert "Traceback" not in res.stderr and res.stderr.count("error:") == 1, res.stderr
    at, kept = int(m.group(1)), int(m.group(2))
    assert 0 < kept < at < 200
    assert "final" not in res.stdout
    with h5py.File(out / "latest.h5", "r") as f:
        assert f.attrs["iteration"] == kept
        for name, ds in f["params"].items():
            for sub in ds.values():
                assert np.isfinite(sub[...]).all(), name
    assert not (out / f"ckpt_{kept + 2}.h5").exists()
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))


def test_diverged_run_exits_3_and_keeps_the_last_finite_checkpoint(trained, tmp_path):
    out = tmp_path / "run"
    res = run_cli_args("train", _diverging(trained, tmp_path), "--out", out)
    _check_diverged(res, out)


@pytest.mark.mpi
def test_diverged_run_exits_3_on_two_ranks(trained, tmp_path):
    from .test_signals import MPIEXEC
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    out = tmp_path / "run"
    res = subprocess.run([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train",
                          _diverging(trained, tmp_path), "--out", str(out)], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    _check_diverged(res, out)


@pytest.mark.parametrize("debug", [False, True])
def test_runtime_failure_is_one_line_per_rank_unless_debug(monkeypatch, capfd, debug):
    """An op failing at run time: ``rank R: op 'name' (Type) failed: ...`` on
    one line, the traceback only with --debug (PURINE_DEBUG=1)."""
    import sys
    from purine_mpi.comm.world import install_abort_handler
    from purine_mpi.base.errors import OpError
    from purine_mpi.graph.core import Op

    class World:
        rank, size, codes = 1, 2, []

        def abort(self, code):
            self.codes.append(code)

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr("threading.excepthook", __import__("threading").excepthook)
    if debug:
        monkeypatch.setenv("PURINE_DEBUG", "1")
    else:
        monkeypatch.delenv("PURINE_DEBUG", raising=False)
    world = World()
    handle = install_abort_handler(world)
    try:
        raise OpError(Op("conv1.fwd", "Conv", [], []), ValueError("boom"), rank=1)
    except OpError as e:
        handle(type(e), e, e.__traceback__)
    err = capfd.readouterr().err
    assert world.codes == [1]
    assert "rank 1: op 'conv1.fwd' (Conv) failed: ValueError: boom" in err
    assert ("Traceback" in err) == debug
    if not debug:
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.mpi
def test_num_output_below_classes_under_two_ranks(digits_h5, tmp_path):
    from .test_signals import MPIEXEC
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = small_net_config(digits_h5)
    cfg["net"][3]["num_output"] = 5
    path = write_config_file(tmp_path, cfg)
    res = subprocess.run([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train", path,
                          "--out", str(tmp_path / "o")], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert 1 <= len(errors) <= 2, res.stderr  # at most one per rank
    assert all("/train/label" in e and "[0, 5)" in e and "layer 'loss'" in e for e in errors)
