"""Trust audit 66: small leftovers of the config, start-up and file checks.

Found (each test says what failed on the code before):

- solver keys the solver type or lr_policy does not read (``momentum2``
  with sgd, ``stepvalues``/``power``/``min_lr`` with step) were accepted
  without a word; now a start-up note names the file, the key and why.
- cosine with ``min_lr`` above ``base_lr`` was accepted, and the rate rose
  over the run (no doc gives a reason); now exit 2 naming file and key.
- ``name: no`` / ``pool: off`` (YAML 1.1 booleans where text is expected)
  said "got False" alone; now the message says YAML read the unquoted word
  as a boolean and to quote it, with the key (base/errors.ConfigError).
- errors found while building the graph of a config changed by ``--set``
  (``--set data.train=null``, ``--set net=[]``) named the file, which holds
  neither value; now they name the ``--set`` (config.blame_override).
- a loss non-finite at the first iteration of a run (``train --init W.h5``
  of weights that overflow) said "Lower solver.base_lr", which cannot
  help: no update has been made; now it says the initial weights (from
  --init, the checkpoint, the fillers) give a non-finite loss.
- ``convert caffe`` wrote its own ``OUT.tmp.PID`` and left it behind when
  the write failed (a traceback past the file-size limit or a full disk);
  now it writes through runfiles.write_replacing, as the data writers do.
- ``predict --out FILE`` replaced a FILE that is not HDF5 (a config, a
  note), where ``data --out`` refuses it; now predict refuses it alike.
"""
import os

import h5py
import numpy as np

from tests.conftest import (quiet_solver, run_cli_args, run_cli_here, small_net_config,
                            write_config_file)


def _line_of(path, text):
    """The number of the first line of the file ``path`` that holds ``text``
    (where a config error names the key written there: FILE:LINE)."""
    with open(path, encoding="utf-8") as f:
        return next(n for n, line in enumerate(f, 1) if text in line)


def test_unused_solver_keys_are_noted_at_start_up(digits_h5, tmp_path):
    cfg = write_config_file(tmp_path, small_net_config(digits_h5, solver=quiet_solver(
        lr_policy="step", stepsize=5, momentum2=0.95, stepvalues=[2, 4], power=2.0,
        min_lr=0.001)))
    res = run_cli_args("train", cfg, "--out", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    # before: none of these lines (the keys were ignored silently)
    for key, why in (("momentum2 0.95", "solver type sgd reads momentum, weight_decay"),
                     ("stepvalues", "lr_policy step reads gamma, stepsize"),
                     ("power 2", "lr_policy step reads gamma, stepsize"),
                     ("min_lr 0.001", "lr_policy step reads gamma, stepsize")):
        line = [l for l in out.splitlines() if f"solver.{key}" in l]
        assert line and f"{cfg}: " in line[0] and "is not used" in line[0] \
            and why in line[0], out
    # the keys the run reads, and a default, get none
    assert "solver.gamma" not in out and "solver.stepsize" not in out
    assert "solver.delta" not in out


def test_cosine_floor_above_base_lr_is_refused(digits_h5, tmp_path):
    cfg = write_config_file(tmp_path, small_net_config(digits_h5, solver=quiet_solver(
        lr_policy="cosine", base_lr=0.05, min_lr=0.1, max_iter=10)))
    res = run_cli_here("graph", cfg)  # every command loads the config alike
    # before: exit 0 (train ran, the rate rising from 0.05 to 0.1 over the run)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"{cfg}:{_line_of(cfg, 'min_lr:')}: key 'solver.min_lr'" in res.stderr \
        and "<= base_lr (0.05)" in res.stderr
    assert "Traceback" not in res.stderr
    # a floor at base_lr (a constant rate) and below it are accepted
    for floor in (0.05, 0.001):
        cfg = write_config_file(tmp_path, small_net_config(digits_h5, solver=quiet_solver(
            lr_policy="cosine", base_lr=0.05, min_lr=floor, max_iter=10)), name="ok.yaml")
        res = run_cli_here("graph", cfg)
        assert res.returncode == 0, res.stderr


def test_yaml_boolean_where_text_is_expected_says_quote_it(digits_h5, tmp_path):
    config = small_net_config(digits_h5)
    config["net"][2]["pool"] = False  # written as pool: off below
    with open(write_config_file(tmp_path, config)) as f:
        text = f.read().replace("pool: false", "pool: off")
    cfg = write_config_file(tmp_path, text, name="off.yaml")
    assert "pool: off" in open(cfg).read()
    res = run_cli_here("graph", cfg)
    assert res.returncode == 2, res.stdout
    err = res.stderr.strip().splitlines()[-1]
    # before: "... expected one of max, ave, avg, average, got False" and no more
    assert f"{cfg}:{_line_of(cfg, 'pool: off')}: key 'net[2].pool'" in err \
        and "got False (YAML read an unquoted" in err, err
    assert "`off`" in err and "pool: 'off'" in err, err
    res = run_cli_here("graph", write_config_file(tmp_path, small_net_config(digits_h5)),
                       "--set", "name=no")
    err = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "--set name=no: key 'name'" in err, err
    assert "`no`" in err and "name: 'no'" in err, err
    # quoted, the word is text and accepted
    res = run_cli_here("graph", write_config_file(tmp_path, small_net_config(digits_h5)),
                       "--set", "name='no'")
    assert res.returncode == 0, res.stderr


def test_graph_errors_of_a_set_value_name_the_set(digits_h5, tmp_path):
    cfg = write_config_file(tmp_path, small_net_config(digits_h5, solver=quiet_solver()))
    for cmd, setting, key in (("graph", "net=[]", "net"),
                              ("graph", "net.4.bottom=fc1", "net[4].bottom"),
                              ("train", "data.train=null", "data.train")):
        extra = ("--out", tmp_path / "run") if cmd == "train" else ()
        res = run_cli_args(cmd, cfg, "--set", setting, *extra)
        err = res.stderr.strip().splitlines()[-1]
        assert res.returncode == 2, res.stdout + res.stderr
        # before: "error: CFG: key 'net': the net has no loss layer ..."
        assert err.startswith(f"error: --set {setting}: key '{key}': "), err
        assert cfg not in err, err
    # a fault of the file itself, with an unrelated --set, still names the file
    broken = small_net_config(digits_h5, solver=quiet_solver())
    broken["net"][4]["bottom"] = "fc1"
    res = run_cli_here("graph", write_config_file(tmp_path, broken, name="b.yaml"),
                       "--set", "solver.base_lr=0.01")
    b = os.path.join(tmp_path, "b.yaml")
    assert res.returncode == 2 and f"{b}:{_line_of(b, 'bottom: fc1')}: key 'net[4].bottom'" \
        in res.stderr, res.stderr


def test_non_finite_loss_before_any_update_blames_the_weights(digits_h5, tmp_path):
    cfg = write_config_file(tmp_path, small_net_config(digits_h5, solver=quiet_solver(max_iter=2)))
    res = run_cli_args("train", cfg, "--out", tmp_path / "a")
    assert res.returncode == 0, res.stderr
    weights = tmp_path / "big.h5"
    weights.write_bytes((tmp_path / "a" / "latest.h5").read_bytes())
    with h5py.File(weights, "r+") as f:  # finite, but the logits overflow float32
        bias = f["params/fc1/bias"]
        bias[...] = np.where(np.arange(bias.shape[0]) % 2, 3e38, -3e38).astype(np.float32)
    res = run_cli_args("train", cfg, "--init", weights, "--out", tmp_path / "b")
    assert res.returncode == 3, res.stdout + res.stderr
    err = res.stderr.strip().splitlines()[-1]
    # before: "error: the training diverged: ... at iteration 1; ... Lower solver.base_lr ..."
    assert "before any update" in err and f"from --init {weights}" in err, err
    assert "Lower solver.base_lr" not in err, err
    # a resume of iteration 2: its weights came from 2 updates at the rate, so
    # the advice on the rate stands (review: it said "before any update")
    res = run_cli_args("train", cfg, "--resume", weights, "--iters", 4, "--out", tmp_path / "c")
    err = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 3 and f"from the checkpoint {weights}" in err, err
    assert "before any update" not in err and "Lower solver.base_lr" in err, err
    assert "at iteration 3, the first of this run" in err, err
    # a rate that blows up after updates keeps the advice on the rate
    res = run_cli_args("train", cfg, "--set", "solver.base_lr=1e30", "--iters", 6,
                       "--out", tmp_path / "d")
    err = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 3 and "Lower solver.base_lr" in err, err


def test_convert_past_the_file_size_limit_leaves_no_temporary_file(digits_h5, tmp_path):
    import os
    import resource
    import subprocess
    from tests.conftest import PYTHON, REPO, cli_env
    out = tmp_path / "out" / "lenet.yaml"
    out.parent.mkdir()
    out.write_text("# the previous config\n")
    limit = 256  # the converted config is some kB

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    fixture = os.path.join(REPO, "tests", "fixtures", "caffe", "lenet_digits.prototxt")
    res = subprocess.run([PYTHON, "-m", "purine_mpi", "convert", "caffe", fixture, "--data",
                          digits_h5, "--out", str(out)], cwd=REPO, env=dict(
                              cli_env(), PYTHONDONTWRITEBYTECODE="1"), preexec_fn=limited,
                         capture_output=True, text=True, timeout=120)
    # before: ['lenet.yaml', 'lenet.yaml.tmp.<pid>'] (and an OSError traceback, exit 1)
    assert os.listdir(out.parent) == ["lenet.yaml"], os.listdir(out.parent)
    assert out.read_text() == "# the previous config\n"
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: {out}: file too large"), \
        res.stderr


def test_predict_refuses_to_replace_a_file_that_is_not_hdf5(digits_h5, tmp_path):
    cfg = write_config_file(tmp_path, small_net_config(digits_h5, solver=quiet_solver()))
    res = run_cli_args("train", cfg, "--out", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    res = run_cli_args("predict", cfg, "--weights", tmp_path / "run" / "latest.h5",
                       "--out", notes)
    # before: exit 0 and notes.txt replaced by the predictions
    assert notes.read_bytes() == b"my notes\n"
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: --out {notes} exists and is not an HDF5 file: writing the predictions there "
        "would replace it; give another --out, or --force to replace it"), res.stderr
    # data says the same of its own (the rule predict now shares)
    res = run_cli_here("data", "digits", "--out", notes)
    assert res.returncode == 2 and "writing the data there would replace it" in res.stderr
    # an HDF5 file there (predictions of an earlier run) is written again
    out = tmp_path / "p.h5"
    for _ in range(2):
        res = run_cli_args("predict", cfg, "--weights", tmp_path / "run" / "latest.h5",
                           "--out", out)
        assert res.returncode == 0, res.stderr
