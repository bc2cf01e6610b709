"""Trust leftovers of the config and the CLI (session 67).

Found (each test says what failed on the code before):

- a refusal between keys caused by a ``--set`` of the *other* key named
  the file: ``--set solver.base_lr=1e-4`` under the file's cosine
  ``min_lr: 0.001`` said "CFG: key 'solver.min_lr'", a key the file holds
  as it always did; now it names the ``--set`` (ConfigError.also: the keys
  a rule between keys read).
- the start-up note on an unused solver key named the job file for a key
  a ``--set`` wrote; now it names the ``--set``.
- ``predict --out`` replaced a data file and ``data --out`` a predictions
  file (or HDF5 of another program) without a word; now exit 2 naming
  what the file holds, unless ``--force``.
- a fresh ``train`` refused at start-up after its folder was made (the
  watched-metric check) left that folder behind (train.log, the lock);
  now it is removed. A resumed folder keeps every file.
- ``train --init W.h5`` with integer weights cast them to float without a
  word; now exit 2 naming the dataset and its dtype.
- a YAML boolean inside a list of names (``bottom: [on, label]``) said
  "got [True, 'label']" alone; now with the hint to quote it.
"""
import functools
import os
import shutil

import h5py
import numpy as np
import pytest

from tests.conftest import (quiet_solver, run_cli_args, run_cli_here, small_net_config,
                            write_config_file)


_solver = functools.partial(quiet_solver, max_iter=2)


# --------------------------------------------------- 1. a --set's refusal
def test_cosine_refusal_names_the_set_of_base_lr(digits_h5, tmp_path):
    cfg = write_config_file(tmp_path, small_net_config(digits_h5, solver=_solver(
        lr_policy="cosine", min_lr=0.001)))
    res = run_cli_here("plan", cfg, "--set", "solver.base_lr=0.0001")
    assert res.returncode == 2, res.stdout + res.stderr
    # before: "error: CFG: key 'solver.min_lr': ..." (the file, which is fine)
    assert res.stderr.strip() == (
        "error: --set solver.base_lr=0.0001: key 'solver.min_lr': 0.001 is above "
        "solver.base_lr 0.0001: lr_policy cosine decays the rate from base_lr down to "
        "min_lr, so it would rise over the run; expected a number <= base_lr (0.0001)"), \
        res.stderr
    # the --set of min_lr itself: that one; the file's own pair: the file
    res = run_cli_here("plan", cfg, "--set", "solver.min_lr=0.5")
    assert res.stderr.startswith("error: --set solver.min_lr=0.5: key 'solver.min_lr': 0.5 "
                                 "is above solver.base_lr 0.05"), res.stderr
    bad = write_config_file(tmp_path, small_net_config(digits_h5, solver=_solver(
        lr_policy="cosine", min_lr=0.5)), name="bad.yaml")
    res = run_cli_here("plan", bad, "--set", "solver.max_iter=3")
    line = 1 + open(bad).read().splitlines().index("  min_lr: 0.5")
    assert res.stderr.startswith(f"error: {bad}:{line}: key 'solver.min_lr': 0.5 is above"), \
        res.stderr


@pytest.mark.parametrize("sets, solver, parallel, key", [
    # lr_policy step without a stepsize: the stepsize is refused, --set made it
    (["solver.lr_policy=step"], {}, None, "solver.stepsize"),
    # micro-batches that do not divide a batch size --set gave
    (["data.train.batch_size=15"], {}, {"micro_batches": 2}, "parallel.micro_batches"),
    # early stopping with a parameter-server mode --set chose
    (["parallel.mode=async"], {"early_stop": {"metric": "loss", "patience": 2}}, None,
     "solver.early_stop"),
])
def test_rules_between_keys_name_the_set_that_broke_them(digits_h5, tmp_path, sets, solver,
                                                         parallel, key):
    config = small_net_config(digits_h5, solver=_solver(**solver))
    if parallel:
        config["parallel"] = parallel
    cfg = write_config_file(tmp_path, config)
    args = [a for s in sets for a in ("--set", s)]
    res = run_cli_here("plan", cfg, *args)
    assert res.returncode == 2, res.stdout + res.stderr
    # before: "error: CFG: key '...'"
    assert res.stderr.startswith(f"error: --set {sets[-1]}: key '{key}': "), res.stderr


# ------------------------------------------------- 2. the unused-key note
def test_unused_solver_key_note_names_the_set(digits_h5, tmp_path):
    from purine_mpi.job.config import load_job, solver_notes
    cfg = write_config_file(tmp_path, small_net_config(digits_h5, solver=_solver(
        momentum2=0.5)))
    notes = solver_notes(load_job(cfg, ["solver.gamma=0.5"]))
    assert notes == [
        # before: "note: CFG: solver.gamma 0.5 is not used: ..."
        "note: --set solver.gamma=0.5: solver.gamma 0.5 is not used: lr_policy fixed reads "
        "none of gamma, stepsize, stepvalues, power, min_lr",
        f"note: {cfg}: solver.momentum2 0.5 is not used: solver type sgd reads momentum, "
        "weight_decay"], notes
    # a --set of a key the file holds too: the --set's value, named by it
    notes = solver_notes(load_job(cfg, ["solver.momentum2=0.7"]))
    assert notes == ["note: --set solver.momentum2=0.7: solver.momentum2 0.7 is not used: "
                     "solver type sgd reads momentum, weight_decay"], notes


# ------------------------------------------ 3. --out of another kind of file
@pytest.fixture(scope="module")
def trained(digits_h5, tmp_path_factory):
    """(config, its run folder) of a 2-iteration run with a checkpoint."""
    where = tmp_path_factory.mktemp("trained")
    cfg = write_config_file(where, small_net_config(digits_h5, solver=_solver(),
                                                    checkpoint={"interval": 1, "keep": 3}))
    res = run_cli_args("train", cfg, "--out", where / "run")
    assert res.returncode == 0, res.stderr
    return cfg, where / "run"


def test_predict_and_data_refuse_to_replace_another_kind_of_file(trained, digits_h5,
                                                                 tmp_path):
    cfg, run = trained
    weights = run / "latest.h5"
    data = tmp_path / "data.h5"
    shutil.copy(digits_h5, data)
    before = data.read_bytes()
    res = run_cli_here("predict", cfg, "--weights", weights, "--out", data)
    assert res.returncode == 2, res.stdout + res.stderr
    # before: exit 0, the data file replaced by the predictions
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: --out {data} exists and holds a data file (top level: test, train): writing "
        "the predictions there would replace it; give another --out, or --force to replace "
        "it"), res.stderr
    assert data.read_bytes() == before
    # data over a predictions file: refused alike
    preds = tmp_path / "preds.h5"
    with h5py.File(preds, "w") as f:
        f.attrs["format"] = "purine_mpi.predictions"
        f["outputs/fc1"] = np.zeros((2, 10), np.float32)
    res = run_cli_here("data", "digits", "--out", preds)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip() == (
        f"error: --out {preds} exists and holds the predictions of predict: writing the data "
        "there would replace it; give another --out, or --force to replace it"), res.stderr
    # HDF5 of another program: refused, naming its top level
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["weights"] = np.arange(3)
    res = run_cli_here("data", "digits", "--out", other)
    assert res.returncode == 2 and "holds HDF5 data of another kind (top level: weights)" \
        in res.stderr, res.stderr
    # --force replaces them; a checkpoint stays refused even then
    res = run_cli_here("data", "digits", "--out", other, "--force")
    assert res.returncode == 0, res.stderr
    with h5py.File(other, "r") as f:
        assert sorted(f) == ["test", "train"]
    ckpt = sorted(p for p in os.listdir(run) if p.startswith("ckpt_"))[0]
    res = run_cli_here("data", "digits", "--out", run / ckpt, "--force")
    assert res.returncode == 2 and "is a purine_mpi checkpoint" in res.stderr, res.stderr
    # the same kind, and an empty HDF5 file, are replaced as before
    res = run_cli_here("data", "digits", "--out", data)
    assert res.returncode == 0, res.stderr
    empty = tmp_path / "empty.h5"
    h5py.File(empty, "w").close()
    res = run_cli_here("data", "digits", "--out", empty)
    assert res.returncode == 0, res.stderr
    res = run_cli_args("predict", cfg, "--weights", weights, "--out", data, "--force")
    assert res.returncode == 0, res.stderr
    with h5py.File(data, "r") as f:
        assert f.attrs["format"] == "purine_mpi.predictions"
    res = run_cli_args("predict", cfg, "--weights", weights, "--out", data)
    assert res.returncode == 0, res.stderr  # predictions over predictions


# ------------------------------------ 4. a refused fresh run leaves no folder
def test_refused_fresh_run_leaves_no_folder_and_a_resumed_one_keeps_its_files(
        trained, digits_h5, tmp_path):
    cfg = write_config_file(tmp_path, small_net_config(
        digits_h5, solver=_solver(test_interval=1),
        checkpoint={"interval": 1, "keep": 3, "best": {"metric": "accurcy"}}))
    res = run_cli_args("train", cfg, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "metric 'accurcy' is not a test figure of this net (did you mean 'accuracy'?)" \
        in res.stderr, res.stderr
    # before: runs/tiny/1 with train.log and .purine.lock
    assert not os.path.exists(tmp_path / "runs"), os.listdir(tmp_path / "runs" / "tiny")
    res = run_cli_args("train", cfg, "--out", tmp_path / "new" / "run")
    assert res.returncode == 2, res.stdout + res.stderr
    assert not os.path.exists(tmp_path / "new")
    # a run folder that was there: every file stays (train.log records the attempt)
    _, run = trained
    folder = tmp_path / "resumed"
    shutil.copytree(run, folder)
    files = {p: (folder / p).read_bytes() for p in os.listdir(folder) if p != "train.log"}
    res = run_cli_args("train", cfg, "--out", folder, "--resume", "auto", "--iters", "4")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "is not a test figure" in res.stderr
    assert {p: (folder / p).read_bytes() for p in os.listdir(folder) if p != "train.log"
            and p != ".purine.lock"} == {p: v for p, v in files.items() if p != ".purine.lock"}
    assert (folder / "train.log").read_text().rstrip().endswith("run ended: user error (exit 2)")


# -------------------------------------------------- 5. integer weights
def test_init_refuses_integer_weights(trained, tmp_path):
    cfg, run = trained
    weights = tmp_path / "int.h5"
    shutil.copy(run / "latest.h5", weights)
    with h5py.File(weights, "a") as f:
        value = f["params/fc1/weight"][()]
        del f["params/fc1/weight"]
        f["params/fc1/weight"] = np.round(value * 100).astype(np.int32)
    res = run_cli_args("train", cfg, "--init", weights, "--out", tmp_path / "run")
    # before: exit 0, the integers cast to float32 without a word
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: weights file '{weights}': dataset '/params/fc1/weight' holds integers (dtype "
        "int32), but the parameter is a float blob: trained weights are floating-point "
        "(float32, as a checkpoint writes them), so this is not a file of trained weights "
        "(quantized weights, indices, or a file edited by another tool?); convert it to "
        "float yourself if you mean those values"), res.stderr
    assert not os.path.exists(tmp_path / "run")


# ---------------------------------------------- 6. YAML 1.1 booleans
def test_no_text_or_number_key_takes_a_yaml_boolean():
    """Every declared key of the sections, the data specs and the layers
    refuses True and False unless it is a boolean key (true/false, or
    in_memory's auto/true/false): an unquoted ``no`` or ``on`` never
    becomes a key's value where text or a number is meant. (Data spec keys
    and fillers have their own rules: data_spec.py and the test below.)"""
    from purine_mpi.base.errors import ConfigError, UserError
    from purine_mpi.job.schema import SECTION_KEYS, TOP
    from purine_mpi.layers.registry import LAYER_SPECS, value_problem
    taken = []
    for t, spec in LAYER_SPECS.items():
        for k in spec.all_keys():
            if k.kind not in ("bool", "filler"):
                taken += [(t, k.name, v) for v in (True, False)
                          if value_problem(k.kind, k.value_range, v) is None]
    for prefix, keys in [("", TOP)] + [(s + ".", ks) for s, ks in SECTION_KEYS.items()]:
        for k in keys:
            if k.check is None or "true" in str(k.type_doc):
                continue
            for v in (True, False):
                try:
                    k.check(prefix + k.name, v, "x.yaml")
                except (ConfigError, UserError):
                    continue
                taken.append((prefix + k.name, v))
    assert taken == [], taken


@pytest.mark.parametrize("key, value", [
    ("net.0.name", "no"), ("net.0.top", "off"), ("net.4.bottom", "[on, label]"),
    ("data.train.path", "yes"), ("data.train.split", "no"), ("data.train.source", "off"),
    ("net.0.weight_filler", "no"), ("parallel.scheme", "off"), ("recompute_layers", "[no]"),
])
def test_a_yaml_boolean_where_text_is_meant_is_refused_with_the_hint(digits_h5, tmp_path, key,
                                                                     value):
    cfg = write_config_file(tmp_path, small_net_config(digits_h5, solver=_solver()))
    res = run_cli_here("plan", cfg, "--set", f"{key}={value}")
    assert res.returncode == 2, res.stdout + res.stderr
    # before (net.4.bottom, a list): "got [True, 'label']" without the hint
    assert "(YAML read an unquoted `" in res.stderr, res.stderr


# ------------------------------------------------- review of the above (session 67)
def test_a_rule_the_file_breaks_alone_names_the_file_not_a_set_of_the_other_key(
        digits_h5, tmp_path):
    """The file's own cosine pair (min_lr 0.5 above base_lr 0.05) is refused
    with or without a --set of base_lr or lr_policy: the file is named."""
    from purine_mpi.base.errors import ConfigError
    from purine_mpi.job.config import resolve_config
    config = small_net_config(digits_h5, solver=_solver(lr_policy="cosine", min_lr=0.5))
    for sets in (["solver.base_lr=0.1"], ["solver.lr_policy=cosine"],
                 ["solver.max_iter=3", "solver.base_lr=0.2"]):
        with pytest.raises(ConfigError) as err:
            resolve_config(config, "CFG", sets, check_files=False)
        # before: "--set solver.base_lr=0.1: key 'solver.min_lr': ..." (the --set
        # of the other key, where the file alone is refused the same way)
        assert str(err.value).startswith("CFG: key 'solver.min_lr': 0.5 is above "
                                         "solver.base_lr"), (sets, str(err.value))
    # the --set that made the refusal is still named (the file alone passes)
    config["solver"]["min_lr"] = 0.001
    with pytest.raises(ConfigError) as err:
        resolve_config(config, "CFG", ["solver.lr_policy=cosine", "solver.base_lr=0.0001"],
                       check_files=False)
    assert str(err.value).startswith("--set solver.base_lr=0.0001: key 'solver.min_lr'"), \
        str(err.value)
    # a --set inside a key the rule read (a layer renamed under the stages' map)
    config = small_net_config(digits_h5)
    config["parallel"] = {"scheme": "pipeline", "stages": {
        "conv1": 0, "relu1": 0, "pool1": 1, "fc1": 1, "loss": 1, "acc": 1}}
    resolve_config(config, "CFG", [], check_files=False)
    with pytest.raises(ConfigError) as err:
        resolve_config(config, "CFG", ["net.3.name=fc9"], check_files=False)
    # before: "CFG: key 'parallel.stages': ..." (the file, whose map fits its net)
    assert str(err.value) == ("--set net.3.name=fc9: key 'parallel.stages': no layer named "
                              "fc1 in the net"), str(err.value)


def test_data_keys_of_another_source_are_named_in_a_note(digits_h5, tmp_path):
    """A synthetic spec switched to hdf5 by --set (jobs/nin_cifar10.yaml's
    way) keeps shape, classes, num_samples, read by nothing; a synthetic
    spec's in_memory likewise: a start-up note names the file or the --set."""
    from purine_mpi.job.config import load_job
    from purine_mpi.job.data_spec import data_notes
    config = small_net_config(digits_h5)
    config["data"] = {"train": {"source": "synthetic", "shape": [1, 8, 8], "classes": 10,
                                "num_samples": 64, "batch_size": 16, "in_memory": False}}
    cfg = write_config_file(tmp_path, config)
    own = "besides batch_size, shuffle, seed and the transform"
    # before: no note (the keys dropped without a word)
    assert data_notes(load_job(cfg)) == [
        f"note: {cfg}: data.train.in_memory False is not read by source synthetic (it reads "
        f"shape, classes, num_samples, split, {own}): a key of another source; drop it, or "
        "set the source it belongs to"]
    sets = ["data.train.source=hdf5", f"data.train.path={digits_h5}", "data.train.split=train",
            "data.train.sequence_length=8"]
    notes = data_notes(load_job(cfg, sets))
    assert notes == [
        f"note: {cfg}: data.train.shape [1, 8, 8], data.train.classes 10, "
        "data.train.num_samples 64 are not read by source hdf5 (it reads path, in_memory, "
        f"external, split, {own}): keys of another source; drop them, or set the source they "
        "belong to",
        "note: --set data.train.sequence_length=8: data.train.sequence_length 8 is not read "
        f"by source hdf5 (it reads path, in_memory, external, split, {own}): a key of "
        "another source; drop it, or set the source it belongs to"], notes
    # the keys the source reads: no note; the job is the same job without them
    plain = small_net_config(digits_h5)
    assert data_notes(load_job(write_config_file(tmp_path, plain, name="plain.yaml"))) == []
    assert load_job(cfg, sets[:3]) == load_job(cfg, sets)


def test_a_folder_that_was_there_is_kept_whatever_this_process_made_before(tmp_path):
    """The record of a folder this process made is dropped when a later run
    finds it there: a run refused at start-up in a folder that was there
    (made by an earlier run of the same process, an API user's loop) keeps
    it; a new --out through a link and .. is removed where it was made."""
    from purine_mpi.base import logfile
    from purine_mpi.job.rundir import choose_run_dir, lock_run_dir, release_run_dirs
    out = tmp_path / "out"
    try:
        choose_run_dir("j", out=str(out))  # made here, no lock (an earlier use)
        (out / "notes.txt").write_text("x")
        (out / "notes.txt").unlink()  # empty again: the user's folder now
        choose_run_dir("j", out=str(out), lock=lock_run_dir)
        logfile.end_run(2)  # a start-up refusal: the hooks release the lock
        # before: the folder was removed (the first call's record of it)
        assert out.is_dir()
        # --out target/../new through a link: the folder made beside the target
        target = tmp_path / "deep" / "target"
        target.mkdir(parents=True)
        os.symlink(target, tmp_path / "link")
        made = tmp_path / "deep" / "new"
        choose_run_dir("j", out=str(tmp_path / "link" / ".." / "new"), lock=lock_run_dir)
        assert made.is_dir()
        logfile.end_run(2)
        # before: deep/new stayed (empty), its record named tmp_path/new
        assert not made.exists() and not (tmp_path / "new").exists()
        assert target.is_dir()
    finally:
        release_run_dirs()
        logfile.new_run()  # the other tests of this process: no run ended


def test_hdf5_kind_of_the_files_our_commands_write_and_others(digits_h5, tmp_path):
    """What ``refuse_other_kind`` tells apart, on files as written: a digits
    data file, a ``data text`` file, HDF5 with attributes only; a file of 0
    bytes (``mktemp x.XXXX.h5``) holds nothing and is replaced."""
    from purine_mpi.base.errors import UserError
    from purine_mpi.data.text import write_text
    from purine_mpi.job.outputs import hdf5_kind, refuse_other_kind
    assert hdf5_kind(digits_h5)[0] == "data"
    src = tmp_path / "a.txt"
    src.write_text("hello world\n" * 50)
    text = tmp_path / "text.h5"
    write_text(str(src), str(text), None, 0.1, log=lambda msg: None)
    assert hdf5_kind(str(text)) == ("data", "")
    attrs = tmp_path / "attrs.h5"
    with h5py.File(attrs, "w") as f:
        f.attrs["owner"] = "me"
    assert hdf5_kind(str(attrs)) == ("other", "no objects, root attributes owner")
    zero = tmp_path / "zero.h5"
    zero.write_bytes(b"")
    assert hdf5_kind(str(zero)) == ("empty", "")
    refuse_other_kind(str(zero), "data", "the data")  # before: "is not an HDF5 file"
    notes = tmp_path / "notes.h5"
    notes.write_text("my notes\n")
    with pytest.raises(UserError, match="is not an HDF5 file"):
        refuse_other_kind(str(notes), "predictions", "the predictions")


def test_a_refused_run_closes_its_lock_before_removing_its_folder(tmp_path, monkeypatch):
    """On NFS a file unlinked while open stays as .nfsXXXX until closed, and
    the folder with it: the lock file is closed before the folder is
    removed (no descriptor of this process on it at the rmdir)."""
    from purine_mpi.base import logfile
    from purine_mpi.job import rundir
    out = tmp_path / "new" / "run"
    seen = []
    real_rmdir = os.rmdir

    def rmdir(path):
        fds = os.listdir("/proc/self/fd")
        targets = []
        for fd in fds:
            try:
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        seen.append([t for t in targets if rundir.LOCK_FILE in t])
        real_rmdir(path)

    monkeypatch.setattr(rundir.os, "rmdir", rmdir)
    try:
        rundir.choose_run_dir("j", out=str(out), lock=rundir.lock_run_dir)
        logfile.end_run(2)
    finally:
        rundir.release_run_dirs()
        logfile.new_run()
    assert not (tmp_path / "new").exists()
    # before: the lock file was still open (".../run/.purine.lock (deleted)")
    assert seen and seen[0] == [], seen
