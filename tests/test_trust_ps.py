"""Trust fixes of the parameter-server paths and of a few commands (session 65).

(1) A parameter-server run whose last test pass is non-finite: the workers
exit 3 (trainer.run_and_report), and before, the server ranks exited 0, so
the launcher's status was 3 only where it took the workers'. Every rank now
ends with the same status, agreed in one collective of the whole world.

(2) The note on resuming a checkpoint of another number of ranks counts the
ranks launched, a parameter-server run's servers too, and says how many of
them are workers.

(3) ``graph --format yaml --np N`` says (stderr, one line) that a rank's
slice is no config of the N-rank run.

(4) ``inspect`` shows bytes >= 0x80 of an ASCII string as escapes instead of
calling the file corrupt.

(5) Found in the audit: a parameter-server run's server checks a --resume
checkpoint against the net as the workers do, and the momenta it holds
alone for NaN (5b).

(6) Found in the audit: ``test`` of a parameter-server job on several ranks
says how to evaluate its weights.

(7, 8) Found in the audit: ``inspect`` of variable-length number sequences
(a traceback before) and of a NaN attribute under --diff (a difference from
itself before).

(9) Found in the audit: ``export onnx`` refuses weights holding NaN (exit 3),
as ``export hf`` does.

(10, 11) Found in the audit: a server checks --init weights for NaN as the
workers do; an --out where nothing can be written is one line, not a
traceback; (12) an async run of no iteration ends without waiting for
state the servers never send.
"""
import json
import os
import re
import subprocess

import h5py
import numpy as np
import pytest
import yaml

from tests.conftest import (MPIEXEC, PYTHON, REPO, cli_env, poisoned_copy, run_cli_args,
                            run_mpi_cli, small_net_config, write_config_file)
from tests.test_trust_mpi_resume import _outlier_h5, _overflow_config


def _each_rank_status(tmp_path, n, *args, timeout=180):
    """``mpiexec -n N python -m purine_mpi ARGS``, each rank's own exit status
    written by a shell around it: (CompletedProcess, {rank: status})."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    marks = tmp_path / "status"
    marks.mkdir()
    script = (f'"{PYTHON}" -m purine_mpi "$@"; s=$?; '
              f'echo $s > "{marks}/rank.${{PMI_RANK:-$OMPI_COMM_WORLD_RANK}}"; exit $s')
    res = subprocess.run([MPIEXEC, "-n", str(n), "sh", "-c", script, "sh", *map(str, args)],
                         cwd=REPO, env=cli_env(), capture_output=True, text=True,
                         timeout=timeout)
    status = {int(p.name.split(".")[1]): int(p.read_text()) for p in marks.iterdir()}
    return res, status


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_every_rank_of_a_ps_run_exits_3_on_a_non_finite_last_test_pass(tmp_path, mode):
    data = tmp_path / "d.h5"
    _outlier_h5(data)
    cfg = _overflow_config(data)
    cfg["parallel"] = {"scheme": "data", "mode": mode, "ps_ranks": 1, "stall_timeout": 30}
    job = write_config_file(tmp_path, cfg)
    out = tmp_path / "run"
    res, status = _each_rank_status(tmp_path, 3, "train", job, "--out", out)
    assert "error: the test pass at iteration 4 gave non-finite figures" in res.stderr, \
        res.stderr
    assert status == {0: 3, 1: 3, 2: 3}, (status, res.stdout, res.stderr)
    assert res.returncode == 3, res.returncode


PS = {"scheme": "data", "mode": "sync_ps", "ps_ranks": 1, "stall_timeout": 30}


@pytest.fixture(scope="module")
def one_rank_run(digits_h5, tmp_path_factory):
    """The tiny net's checkpoint of 2 iterations on one rank (read only)."""
    base = tmp_path_factory.mktemp("one")
    one = write_config_file(base, small_net_config(digits_h5), "one.yaml")
    first = run_cli_args("train", one, "--out", base / "a", "--iters", "2")
    assert first.returncode == 0, first.stderr
    return base / "a" / "latest.h5"


@pytest.mark.mpi
def test_a_ps_resume_note_counts_the_ranks_launched(tmp_path, digits_h5, one_rank_run):
    """(2) A 3-rank parameter-server run (2 workers, 1 server) resuming a
    1-rank checkpoint: before, the note said "this run has 2" (the workers)
    of the 3 ranks launched, and its own checkpoints recorded world_size 2."""
    cfg = small_net_config(digits_h5)
    cfg["parallel"] = dict(PS)
    ps = write_config_file(tmp_path, cfg, "ps.yaml")
    res = run_mpi_cli(3, "train", ps, "--out", tmp_path / "b", "--resume", one_rank_run,
                      "--iters", "4")
    assert res.returncode == 0, res.stderr
    assert "note: resuming a 1-rank checkpoint on 3 rank(s) (2 workers, 1 parameter " \
        "server(s)), layout [data: 1 replica, 1 rank] -> [data: 2 replicas, 2 ranks]" \
        in res.stdout, res.stdout
    assert "was written by 1 rank(s) with a global batch of 16, this run has 3 (2 workers, " \
        "1 parameter server(s)): the global batch is now 32 (16 per worker x 2)" \
        in res.stdout, res.stdout
    with h5py.File(tmp_path / "b" / "latest.h5", "r") as f:
        assert int(f.attrs["world_size"]) == 3
    # and back on one rank: the file's 3 ranks, 2 of them workers
    back = run_cli_args("train", write_config_file(tmp_path, small_net_config(digits_h5)),
                        "--out", tmp_path / "c", "--resume", tmp_path / "b" / "latest.h5",
                        "--iters", "5")
    assert back.returncode == 0, back.stderr
    assert "note: resuming a 3-rank checkpoint (2 workers) on 1 rank(s), layout " \
        "[data: 2 replicas, 2 ranks] -> [data: 1 replica, 1 rank]" in back.stdout, back.stdout


def test_graph_yaml_of_a_rank_slice_says_it_is_no_config_of_the_run(tmp_path, digits_h5):
    """(3) ``graph --format yaml --np 2`` prints rank 0's slice (its reader
    shard 0 of 2, its gradients scaled by 1/2), which loads as a config that
    trains alone on one rank: before, without a word. Now one stderr line says
    so; without --np (or with --np 1) nothing is said."""
    job = write_config_file(tmp_path, small_net_config(digits_h5))
    res = run_cli_args("graph", job, "--format", "yaml", "--np", "2")
    assert res.returncode == 0, res.stderr
    graph = yaml.safe_load(res.stdout)["graph"]
    reader = next(e for e in graph if e.get("op_type") == "DataReader")
    assert (reader["attrs"]["rank"], reader["attrs"]["world_size"]) == (0, 2)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "note: this is rank 0's slice of the graph composed for 2 ranks"), res.stderr
    assert "not a config of the 2-rank run" in lines[0]
    for np_ in ([], ["--np", "1"]):
        plain = run_cli_args("graph", job, "--format", "yaml", *np_)
        assert plain.returncode == 0 and plain.stderr == "", plain.stderr
    text = run_cli_args("graph", job, "--np", "2")
    assert text.returncode == 0 and text.stderr == "", text.stderr


def test_inspect_shows_non_ascii_bytes_of_an_ascii_string_as_escapes(tmp_path):
    """(4) HDF5 stores an ASCII string's bytes as given: bytes >= 0x80 in one
    make a valid file. Before, ``inspect`` exited 2 calling it corrupt
    (h5py's strict ASCII decoding: ``'x.h5' is corrupt: UnicodeDecodeError``)
    and showed such an attribute with U+FFFD in place of the bytes."""
    path = tmp_path / "x.h5"
    ascii_type = h5py.string_dtype("ascii")
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.arange(3.0))
        f.create_dataset("name", data=b"na\xefve", dtype=ascii_type)
        f.create_dataset("fixed", data=np.bytes_(b"ab\xff"))
        f.create_dataset("names", data=np.array([b"caf\xe9", b"ok"], dtype=object),
                         dtype=ascii_type)
        f.attrs.create("note", b"r\xe9sum\xe9", dtype=ascii_type)
        f.attrs.create("notes", np.array([b"r\xe9", b"x"], dtype=object), dtype=ascii_type)
    res = run_cli_args("inspect", path)
    assert res.returncode == 0, res.stderr
    assert "corrupt" not in res.stderr
    lines = res.stdout.splitlines()
    assert "  @note = r\\xe9sum\\xe9" in lines, res.stdout
    assert any(line.startswith("/name ") and line.endswith(" na\\xefve") for line in lines), \
        res.stdout
    assert any(line.startswith("/fixed ") and line.endswith(" ab\\xff") for line in lines), \
        res.stdout
    assert any(line.startswith("/w ") for line in lines), res.stdout
    js = run_cli_args("inspect", path, "--json")
    assert js.returncode == 0, js.stderr
    report = json.loads(js.stdout)
    assert report["attrs"] == {"note": "r\\xe9sum\\xe9", "notes": ["r\\xe9", "x"]}
    values = {d["name"]: d.get("value") for d in report["datasets"]}
    assert values["/name"] == "na\\xefve" and values["/fixed"] == "ab\\xff", values
    # --diff of the file with itself: the same strings, equal
    same = run_cli_args("inspect", path, "--diff", path, "--json")
    assert same.returncode == 0, same.stderr
    assert all(row.get("equal", True) for row in json.loads(same.stdout)["diff"]["datasets"])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_a_ps_resume_of_another_nets_checkpoint_is_a_user_error(tmp_path, digits_h5,
                                                                 one_rank_run, mode):
    """(5, found in this session's audit) ``--resume`` of a checkpoint of
    another net in a parameter-server run: the workers refused it (exit 2,
    naming the missing parameters), but the server read the file unchecked
    and died on ``rank 2: KeyError: 'head/weight'``, ending the job with
    exit 1, a runtime failure. The server now checks it as the workers do."""
    cfg = small_net_config(digits_h5)
    for layer in cfg["net"]:  # fc1 renamed: a net the checkpoint does not hold
        layer.update({k: "head" if v == "fc1" else ["head" if b == "fc1" else b for b in v]
                      if isinstance(v, list) else v for k, v in layer.items()
                      if k in ("name", "top", "bottom")})
    cfg["parallel"] = dict(PS, mode=mode, max_staleness=1)
    ps = write_config_file(tmp_path, cfg, "ps.yaml")
    res = run_mpi_cli(3, "train", ps, "--out", tmp_path / "b", "--resume", one_rank_run)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "KeyError" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1] == f"error: {one_rank_run}: checkpoint lacks parameter(s) head/weight, " \
        "head/bias of this net", res.stderr


@pytest.mark.mpi
def test_test_of_a_ps_job_on_several_ranks_says_what_to_do(tmp_path, digits_h5, one_rank_run):
    """(6, audit) ``mpiexec -n 2 ... test`` of a parameter-server job: before,
    ``key 'parallel.mode': mode 'sync_ps' runs through the parameter-server
    trainer``, which names no way on. It now says how to evaluate the
    weights, and that way gives the figures of one rank."""
    cfg = small_net_config(digits_h5)
    cfg["parallel"] = dict(PS)
    ps = write_config_file(tmp_path, cfg, "ps.yaml")
    res = run_mpi_cli(2, "test", ps, "--weights", one_rank_run)
    assert res.returncode == 2, res.stderr
    # the file's line of the key (a ConfigError, located as every config key is)
    line = res.stderr.strip().splitlines()[-1]
    assert re.match(rf"error: {re.escape(str(ps))}:\d+: key", line), line
    assert line.endswith(": key 'parallel.mode': mode 'sync_ps' (parameter servers) runs in "
                         "train and bench only; evaluate its weights on one rank, or on several "
                         "with --set parallel.mode=sync"), res.stderr
    two = run_mpi_cli(2, "test", ps, "--weights", one_rank_run, "--set", "parallel.mode=sync")
    one = run_cli_args("test", ps, "--weights", one_rank_run)
    assert two.returncode == 0 and one.returncode == 0, (two.stderr, one.stderr)
    a, b = json.loads(two.stdout), json.loads(one.stdout)
    assert a["samples"] == b["samples"] == 360 and a["accuracy"] == b["accuracy"], (a, b)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)


def test_inspect_of_variable_length_numbers_and_a_nan_attribute(tmp_path):
    """(7, audit) A dataset of variable-length integer sequences (dtype object,
    not text): before, ``inspect`` ended in a traceback (``TypeError:
    dset.asstr() can only be used on datasets with an HDF5 string
    datatype``, exit 1). Now shown by shape as ``vlen int32``, and equal to
    itself under --diff. (8) ``--diff`` of a file with itself said
    ``attribute @n: nan vs nan``: a NaN attribute is now no difference, as a
    NaN in the same place of a dataset is not."""
    path, other = tmp_path / "v.h5", tmp_path / "w.h5"
    for p, last in ((path, [3]), (other, [4])):
        with h5py.File(p, "w") as f:
            f.create_dataset("seq", data=np.array([np.array([1, 2]), np.array(last)],
                                                  dtype=object),
                             dtype=h5py.vlen_dtype(np.int32))
            f.attrs["n"] = np.nan
            f.attrs["arr"] = np.array([1.5, np.nan])
    res = run_cli_args("inspect", path)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    row = next(line for line in res.stdout.splitlines() if line.startswith("/seq "))
    assert row.split()[1:] == ["2", "vlen", "int32"], row
    same = run_cli_args("inspect", path, "--diff", path, "--json")
    assert same.returncode == 0, same.stderr
    diff = json.loads(same.stdout)["diff"]
    assert diff["attrs"] == {} and diff["datasets"] == [{"name": "/seq", "equal": True,
                                                              "status": "equal"}], diff
    text = run_cli_args("inspect", path, "--diff", path)
    assert "attribute @" not in text.stdout, text.stdout
    changed = json.loads(run_cli_args("inspect", path, "--diff", other, "--json").stdout)
    assert changed["diff"]["datasets"] == [{"name": "/seq", "equal": False,
                                                "status": "differs"}], changed


def test_export_onnx_refuses_non_finite_weights_as_export_hf_does(tmp_path, one_rank_run,
                                                                    digits_h5):
    """(9, audit) ``export onnx`` of weights holding a NaN wrote the model and
    exited 0, where ``export hf``, ``test``, ``predict`` and ``generate`` of
    such weights exit 3 naming the blob. Now exit 3, nothing written."""
    pytest.importorskip("onnx")
    bad = poisoned_copy(one_rank_run, tmp_path / "nan.h5", "params/fc1/weight")
    job = write_config_file(tmp_path, small_net_config(digits_h5))
    out = tmp_path / "m.onnx"
    res = run_cli_args("export", "onnx", job, "--weights", bad, "--out", out)
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    assert f"error: weights file '{bad}' holds non-finite values (NaN or inf) in blob " \
        "'fc1/weight' (1 of 640)" in res.stderr, res.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == \
        ["cfg.yaml", "nan.h5"]
    good = run_cli_args("export", "onnx", job, "--weights", one_rank_run, "--out", out)
    assert good.returncode == 0 and out.exists(), good.stderr


def test_export_onnx_takes_a_run_folder_as_export_hf_does(tmp_path, one_rank_run, digits_h5):
    """``export onnx --weights RUN`` was refused (an HDF5 error on a folder)
    where ``export hf``, ``test`` and ``generate`` take a run folder (its
    latest.h5): the same model as from the file."""
    pytest.importorskip("onnx")
    job = write_config_file(tmp_path, small_net_config(digits_h5))
    from_file = run_cli_args("export", "onnx", job, "--weights", one_rank_run,
                             "--out", tmp_path / "file.onnx")
    from_run = run_cli_args("export", "onnx", job, "--weights", one_rank_run.parent,
                            "--out", tmp_path / "run.onnx")
    assert from_file.returncode == 0, from_file.stderr
    assert from_run.returncode == 0, from_run.stderr
    assert (tmp_path / "run.onnx").read_bytes() == (tmp_path / "file.onnx").read_bytes()


@pytest.mark.mpi
def test_a_ps_resume_of_a_nan_momentum_is_refused_naming_it(tmp_path, digits_h5,
                                                            one_rank_run):
    """(5b) The servers hold the momenta, which the workers never check: a
    --resume checkpoint whose momentum holds a NaN trained on, its first
    update made the weights NaN, and the run said ``the training diverged
    ... 'ckpt' stays the last finite checkpoint ... Lower solver.base_lr``,
    which is wrong on both counts. Now exit 3 naming the blob, as a resume
    on data-parallel ranks says. (Review: found by the server alone, it was
    its own 'error: rank 2: ...' and an abort, one line per server; the
    workers now check the servers' momenta too: one message.)"""
    bad = poisoned_copy(one_rank_run, tmp_path / "nan_momentum.h5",
                        "solver/fc1/weight/momentum")
    cfg = small_net_config(digits_h5)
    cfg["parallel"] = dict(PS)
    ps = write_config_file(tmp_path, cfg, "ps.yaml")
    res = run_mpi_cli(3, "train", ps, "--out", tmp_path / "b", "--resume", bad, "--iters", "4")
    assert res.returncode == 3, (res.returncode, res.stderr)
    assert "diverged" not in res.stderr, res.stderr
    # every rank finds it (the workers check the momenta the servers will
    # hold): one message by rank 0, not the server's own 'error: rank 2: ...'
    # and an abort (with two servers, one line each, each naming its blob)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint '{bad}' holds non-finite values (NaN or inf) in blob "
        "'fc1/weight.momentum' (1 of 640)"), res.stderr


@pytest.mark.mpi
def test_a_ps_init_of_nan_weights_ends_every_rank_with_one_message(tmp_path, digits_h5,
                                                                   one_rank_run):
    """(10, audit) ``--init`` of weights holding a NaN in a parameter-server
    run: the workers refused them, the server did not look, so the ranks did
    not agree on the error and each worker printed its own line (``error:
    rank 0: ...``, ``error: rank 1: ...``) and aborted the job. The server
    now checks them as the workers do: one line, exit 3. (And with the
    servers finding the error too, every rank ends the same way: before, a
    server without threads waited in MPI_Finalize and Hydra, seeing a worker
    end by os._exit, killed it: exit 9 in 10 of 12 runs of 4 ranks with an
    --init of another net, 1 of 12 since, comm/world.report_user_error.)"""
    bad = poisoned_copy(one_rank_run, tmp_path / "nan.h5", "params/conv1/weight", np.inf)
    cfg = small_net_config(digits_h5)
    cfg["parallel"] = dict(PS)
    ps = write_config_file(tmp_path, cfg, "ps.yaml")
    res = run_mpi_cli(3, "train", ps, "--out", tmp_path / "b", "--init", bad, "--iters", "4")
    assert res.stderr.count("error:") == 1, res.stderr
    assert f"error: weights file '{bad}' holds non-finite values (NaN or inf) in blob " \
        "'conv1/weight' (1 of 36)" in res.stderr, res.stderr
    assert res.returncode == 3, (res.returncode, res.stderr)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("command", ["export onnx", "predict", "data digits"])
@pytest.mark.parametrize("where", ["/proc/purine_out.h5", "/proc/purine_dir/out.h5"])
def test_an_output_where_no_file_can_be_made_is_one_line(tmp_path, digits_h5, one_rank_run,
                                                         command, where):
    """(11, audit) An --out where no file or folder can be made (/proc here;
    a read-only file system or a folder without write permission alike):
    before, a Python traceback and exit 1 (``FileNotFoundError: ...
    '/proc/purine_out.h5.tmp.123'``); now one line naming the path, exit 2."""
    if command == "export onnx":
        pytest.importorskip("onnx")
    job = write_config_file(tmp_path, small_net_config(digits_h5))
    args = {"export onnx": ["export", "onnx", job, "--weights", one_rank_run],
            "predict": ["predict", job, "--weights", one_rank_run],
            "data digits": ["data", "digits"]}[command]
    res = run_cli_args(*args, "--out", where)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    folder = os.path.dirname(where)
    assert last in (f"error: {where}: cannot be written there (No such file or directory); "
                    "give another --out",
                    f"error: {folder}: cannot make this folder (No such file or directory); "
                    "give another --out"), last
    assert last.startswith(f"error: {where}:" if folder == "/proc" else f"error: {folder}:")


@pytest.mark.mpi
def test_an_async_run_of_no_iteration_ends_without_waiting(tmp_path, digits_h5):
    """(12, audit) ``train --iters 0`` (or ``solver.max_iter: 0``) in mode
    async: rank 0 waited for the servers' state before its checkpoint, which
    the servers (nothing trained) never send, and every rank hung until
    the stall timeout (``rank 0: the server state (momenta) from rank 2
    stalled``, exit 1). Now the run ends at once, as in sync_ps: the test
    pass of the starting weights and a checkpoint of iteration 0."""
    cfg = small_net_config(digits_h5)
    cfg["parallel"] = dict(PS, mode="async", max_staleness=1, stall_timeout=10)
    job = write_config_file(tmp_path, cfg)
    res = run_mpi_cli(3, "train", job, "--out", tmp_path / "b", "--iters", "0", timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr)
    assert "stalled" not in res.stderr, res.stderr
    assert "test @ iter 0:" in res.stdout, res.stdout
    with h5py.File(tmp_path / "b" / "latest.h5", "r") as f:
        assert int(f.attrs["iteration"]) == 0
