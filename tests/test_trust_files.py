"""Trust audit of files and faults (session 55): what a run writes and
what it reports when something goes wrong. A test pass never runs on
non-finite weights (no accuracy of a diverged net in metrics.jsonl, no
``best_<iter>.h5`` holding NaN); early stopping on passes without a finite
figure ends in its one line, not a TypeError; ``memory.json`` is never
written through a link; a checkpoint or trace over ``ulimit -f`` is one
line naming the file (the trace stays JSON), another write error names it
too; a trace's rows nest as Perfetto needs; ``graph --format dot`` quotes
every name so that Graphviz reads it; a relative data path naming two
different files is refused, a resume onto another data file says so; and
``--force`` with a bad ``--resume``/``--init`` file deletes nothing."""
import json
import os

from purine_mpi.train.trainer import Trainer
from tests.conftest import (FakeWorld, make_job, run_cli_args, small_net_config,
                            write_config_file)


def _trainer(tmp_path, digits_h5, checkpoint=None, **solver):
    cfg = small_net_config(str(digits_h5))
    cfg["solver"].update(solver)
    cfg["checkpoint"].update(checkpoint or {})
    return Trainer(make_job(cfg), str(tmp_path / "run"), world=FakeWorld(), log=lambda m: None)


def _run(trainer):
    try:
        return trainer.run()
    finally:
        trainer.close()


def test_no_test_pass_and_no_best_checkpoint_on_non_finite_weights(tmp_path, digits_h5):
    """base_lr 1e39 is inf in float32: iteration 1's loss is finite (the
    initial weights), its update makes the weights inf/NaN. The test pass
    due after it must not run: its accuracy of a NaN net was recorded as a
    figure and, with checkpoint.best on accuracy, best_1.h5 was written
    holding NaN weights (no checkpoint is ever written with non-finite
    weights: docs/failures.md, exit 3)."""
    t = _trainer(tmp_path, digits_h5, {"best": {"metric": "accuracy"}}, base_lr=1e39,
                 max_iter=4, display=1, test_interval=1)
    result = _run(t)
    run = tmp_path / "run"
    assert not list(run.glob("*.h5")), sorted(p.name for p in run.iterdir())
    assert result.get("diverged_at") == 1, result
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if r["phase"] == "test"] == [], rows


def test_early_stopping_without_a_finite_figure_says_so():
    """A metric that was never finite (every pass NaN: an overflow of the
    test data only) leaves no best figure: the stop's line said
    ``{self.best:.4f}`` of None, a TypeError (exit 1) instead of the stop."""
    from purine_mpi.job.keys import EarlyStopSpec
    from purine_mpi.train.watch import EarlyStopping
    said = []
    stop = EarlyStopping(EarlyStopSpec(metric="loss", patience=2), said.append)
    nan = {"loss": float("nan"), "samples": 60}
    assert stop.after_test(1, nan) is False
    assert stop.after_test(2, nan) is True
    assert said == ["early stop at iteration 2: loss has not improved by more than 0 in 2 "
                    "test pass(es) (no pass gave a finite figure)"], said
    assert stop.state()["best"] is None


def test_memory_json_is_never_written_through_a_link(tmp_path):
    """memory.json (and parallel.scheme auto's calibration.json) planted as
    a link to a file outside the run folder: the set-up refuses it (exit 2
    naming it), as it does every run file; and the end's write replaces the
    name, it never writes through (``open(..., "w")`` overwrote the file
    outside)."""
    from types import SimpleNamespace

    import pytest

    from purine_mpi.base.errors import UserError
    from purine_mpi.job.rundir import prepare_run_dir, release_run_dirs
    from purine_mpi.train.trainer import write_memory
    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file\n")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("memory.json", "calibration.json"):
        (run / name).symlink_to(victim)
        with pytest.raises(UserError, match=f"{name}: is a symbolic link"):
            prepare_run_dir(FakeWorld(), "trust", out=str(run))
        release_run_dirs()  # the process would end here (exit 2)
        (run / name).unlink()
    (run / "memory.json").symlink_to(victim)  # planted after the set-up
    trainer = SimpleNamespace(world=FakeWorld(), out_dir=str(run), model_state=dict,
                              state=SimpleNamespace(loop_peak_rss=None, loop_peer_window=None),
                              scheme=None)
    write_memory(trainer, None)
    assert victim.read_text() == "another user's file\n"
    assert not (run / "memory.json").is_symlink()
    assert json.loads((run / "memory.json").read_text())["ranks"][0]["rank"] == 0


def _under_file_size_limit(code, path, limit):
    """``python -c code path`` in a process whose file-size limit
    (``ulimit -f``, RLIMIT_FSIZE) is ``limit`` bytes: the CompletedProcess."""
    import resource
    import subprocess
    import sys

    from tests.conftest import REPO, cli_env

    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=60, preexec_fn=preexec)


def test_a_checkpoint_over_the_file_size_limit_is_one_line_naming_it(tmp_path):
    """``ulimit -f`` (RLIMIT_FSIZE, set in a real process: Python ignores
    SIGXFSZ, so the write fails with EFBIG): the checkpoint is one
    UserError naming the file (it was ``OSError: [Errno 27] File too
    large``, no file named, exit 1), the previous checkpoint stays whole
    and loadable, and no temporary file is left. Another error of a write
    (EIO) keeps its own exit but names the file."""
    import numpy as np

    from purine_mpi.job.checkpoint_file import load_checkpoint, save_checkpoint
    path = tmp_path / "latest.h5"
    save_checkpoint(path, {"w": np.ones(4, np.float32)}, iteration=1)
    before = path.read_bytes()
    code = ("import sys, numpy as np\n"
            "from purine_mpi.base.errors import UserError\n"
            "from purine_mpi.job.checkpoint_file import save_checkpoint\n"
            "try:\n"
            "    save_checkpoint(sys.argv[1], {'w': np.zeros(1 << 18, np.float32)}, iteration=2)\n"
            "except UserError as e:\n"
            "    print('UserError:', e)\n")
    res = _under_file_size_limit(code, path, 64 << 10)
    assert res.stdout.startswith(f"UserError: {path}: file too large"), (res.stdout, res.stderr)
    assert res.returncode == 0 and "\n" not in res.stdout.strip()
    assert sorted(os.listdir(tmp_path)) == ["latest.h5"]
    assert path.read_bytes() == before and load_checkpoint(path).iteration == 1


def test_another_write_error_of_a_checkpoint_names_the_file(tmp_path, monkeypatch):
    import errno

    import numpy as np
    import pytest

    from purine_mpi.job.checkpoint_file import save_checkpoint
    path = tmp_path / "ckpt_2.h5"

    def write(fd, data):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "write", write)
    with pytest.raises(OSError) as err:
        save_checkpoint(path, {"w": np.zeros(1000, np.float32)}, iteration=2)
    monkeypatch.undo()
    assert err.value.errno == errno.EIO and err.value.filename == str(path), err.value
    assert os.listdir(tmp_path) == []


def test_a_trace_over_the_file_size_limit_is_one_line_and_stays_json(tmp_path):
    """``ulimit -f`` (or a full disk) while ``--profile`` streams the trace:
    one UserError naming the file (it was ``OSError: [Errno 27] File too
    large`` naming none, exit 1, and the file cut mid-event at the limit),
    and the file keeps its whole chunks and ends as JSON Perfetto reads."""
    path = tmp_path / "trace.rank0.json"
    code = ("import sys\n"
            "from purine_mpi.graph.core import Op\n"
            "from purine_mpi.runtime.trace import TraceFile\n"
            "tf = TraceFile(sys.argv[1], chunk=64)\n"
            "op = Op('conv1.fwd', 'Conv', [], [])\n"
            "try:\n"
            "    for it in range(10000):\n"
            "        tf.record(op, 'compute', 1.0 + it, 1.5 + it, it, 0)\n"
            "except Exception as e:\n"
            "    print(type(e).__name__ + ':', e)\n"
            "try:\n"
            "    tf.close()\n"
            "except Exception as e:\n"
            "    print('close:', type(e).__name__)\n")
    res = _under_file_size_limit(code, path, 16 << 10)
    assert res.stdout.startswith(f"UserError: {path}: file too large"), (res.stdout, res.stderr)
    events = json.loads(path.read_text())["traceEvents"]  # whole chunks, then ]}
    spans = [e["args"]["iter"] for e in events if e["ph"] == "X"]
    assert spans and spans == list(range(len(spans))), spans
    assert path.stat().st_size <= 16 << 10


def _dot_strings(text):
    """The quoted strings of DOT ``text`` as Graphviz reads them (only
    ``\\"`` is an escape inside quotes); an AssertionError where a string
    does not end (a name's backslash made ``\\"`` of the closing quote)."""
    out, i = [], 0
    while True:
        i = text.find('"', i)
        if i < 0:
            return out
        j = i + 1
        while j < len(text) and text[j] != '"':
            j += 2 if text[j] == "\\" else 1
        assert j < len(text), f"unterminated DOT string at {text[i:i + 60]!r}"
        assert "\n" not in text[i:j], f"a DOT string ran past its line: {text[i:j][:80]!r}"
        out.append(text[i + 1:j])
        i = j + 1


def test_graph_dot_quotes_backslashes_and_quotes_of_names():
    """Layer and blob names are free strings: one ending in a backslash
    (``fc\\``) made the closing quote an escaped one, and ``dot`` refused
    the file (``syntax error in line 8 near '\\'``)."""
    import shutil
    import subprocess

    from purine_mpi.tools.graph import render_graph
    cfg = {"name": "odd",
           "data": {"train": {"source": "synthetic", "shape": [4], "classes": 3,
                              "batch_size": 2}},
           "net": [{"type": "fc", "name": "fc\\", "bottom": "data", "top": 'h"x\\',
                    "num_output": 3},
                   {"type": "softmax_loss", "name": "loss", "bottom": ['h"x\\', "label"],
                    "top": "loss"}]}
    text = render_graph(make_job(cfg), fmt="dot")
    strings = _dot_strings(text)
    assert "b:fc\\\\/weight" in strings and 'b:h\\"x\\\\' in strings, strings
    assert 'h\\"x\\\\\\n[2, 3]' in strings  # the label: the name, then DOT's line break
    if shutil.which("dot"):
        res = subprocess.run(["dot", "-Tsvg"], input=text, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        assert "fc\\.fwd" in res.stdout  # the label as drawn: one backslash


def _partly_overlapping(events):
    """{tid: number of complete events that start inside an earlier event
    of their row and end after it}: what Perfetto drops
    (slice_drop_overlapping_complete_event; X events of a row must nest)."""
    rows = {}
    for e in events:
        if e["ph"] == "X":
            rows.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    out = {}
    for tid, spans in rows.items():
        stack, bad = [], 0
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            bad += bool(stack and end > stack[-1])
            stack.append(end)
        out[tid] = bad
    return out


def test_trace_rows_nest_as_perfetto_needs(tmp_path):
    """The comm thread's ops are in flight at once (several buckets'
    allreduces, a pipeline's waits): on one row their complete events
    overlapped without nesting (2 ranks of digits_lenet: 46 of 100 comm
    events), which Perfetto drops. They go to rows comm.2, comm.3, ...
    (each named), nested parts stay on their op's row, and a worker's
    sequential ops stay on its own row."""
    from purine_mpi.graph.core import Op
    from purine_mpi.runtime.trace import TraceFile
    path = tmp_path / "trace.rank0.json"
    tf = TraceFile(str(path), chunk=7)
    for it in range(3):
        t = 10.0 * it
        for k in range(4):  # four buckets' allreduces, posted 1 s apart, 3.5 s each
            start = t + k
            tf.record(Op(f"grad_bucket{k}.allreduce", "AllReduce", [], []), "comm",
                      start, start + 3.5, it, "comm")
            tf.record(Op(f"grad_bucket{k}.allreduce:part", "AllReduce", [], []), "rma",
                      start + 0.5, start + 1.5, it, "comm")
            tf.record(Op(f"op{k}", "Conv", [], []), "compute", t + k, t + k + 0.9, it, 0)
    tf.close()
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 36
    assert _partly_overlapping(events) == dict.fromkeys(_partly_overlapping(events), 0), \
        _partly_overlapping(events)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {e["tid"] for e in spans} <= set(names)
    assert names["comm.2"] == "MPI progress (comm) 2" and "comm.5" not in names
    assert {e["tid"] for e in spans if e["cat"] == "compute"} == {"0"}
    row = {e["name"]: e["tid"] for e in spans if e["args"]["iter"] == 1}
    assert all(row[f"grad_bucket{k}.allreduce:part"] == row[f"grad_bucket{k}.allreduce"]
               for k in range(4)), row


def test_a_data_path_that_names_two_files_is_refused(tmp_path, digits_h5, monkeypatch):
    """A relative data path resolves against the working directory or the
    config's folder (docs/config.md). Where both hold a file and they
    differ, the working directory's was read without a word, so the same
    config trained on another file by the folder it was started from (and
    a ``--resume`` from elsewhere went on with the other one): exit 2
    naming both. The same file reached both ways (a run from the config's
    folder), or two copies of the same bytes, is no ambiguity."""
    import shutil

    import pytest

    from purine_mpi.base.errors import ConfigError
    from tests.conftest import write_config_file
    import h5py
    jobs = tmp_path / "jobs"
    for folder in (tmp_path, jobs):
        (folder / "data").mkdir(parents=True)
        shutil.copy(digits_h5, folder / "data" / "digits.h5")
    with h5py.File(jobs / "data" / "digits.h5", "a") as f:  # another version of the data
        f.attrs["version"] = 2
    cfg = small_net_config("data/digits.h5")
    path = str(write_config_file(jobs, cfg))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        make_job(cfg, path)
    text = str(err.value)
    assert "key 'data.train.path': 'data/digits.h5' names two different data files" in text, text
    assert f"'{tmp_path}/data/digits.h5' (from the working directory)" in text, text
    assert f"'{jobs}/data/digits.h5' (beside the config)" in text, text
    monkeypatch.chdir(jobs)
    assert make_job(cfg, path).data.train.path == str(jobs / "data" / "digits.h5")
    shutil.copy(jobs / "data" / "digits.h5", tmp_path / "data" / "digits.h5")
    monkeypatch.chdir(tmp_path)  # the same bytes: the working directory's, as before
    assert make_job(cfg, path).data.train.path == str(tmp_path / "data" / "digits.h5")


def test_a_resume_onto_another_data_file_says_so(tmp_path, digits_h5):
    """A resume whose data path resolves to another file than the one the
    checkpoint's run read (a relative path from another folder or host)
    went on without a word: a note names both paths."""
    import shutil
    first, second = tmp_path / "a.h5", tmp_path / "b.h5"
    shutil.copy(digits_h5, first)
    shutil.copy(digits_h5, second)
    said = []
    for data, resume in ((first, None), (second, str(tmp_path / "run" / "latest.h5"))):
        cfg = small_net_config(str(data))
        cfg["solver"].update(max_iter=2 if resume is None else 4, display=0)
        _run(Trainer(make_job(cfg), str(tmp_path / "run"), world=FakeWorld(), resume=resume,
                     log=said.append))
    notes = [line for line in said if line.startswith("note: resuming from")]
    assert notes == [f"note: resuming from {tmp_path}/run/latest.h5: data.train.path is "
                     f"'{second}', the run that wrote it read '{first}'; data.test.path is "
                     f"'{second}', the run that wrote it read '{first}' (another file, or the "
                     "same one under another path)"], said


def test_force_with_a_bad_resume_or_init_file_deletes_nothing(tmp_path, digits_h5):
    """``--force --resume FILE`` (or ``--force --init W``) deletes the
    folder's run and starts from FILE: a FILE that is missing or damaged
    was found only after the deletion (exit 2, and the previous run was
    gone). Now exit 2 first, every file in place."""
    import pytest

    from purine_mpi.base.errors import UserError
    from purine_mpi.job.rundir import choose_run_dir
    t = _trainer(tmp_path, digits_h5, max_iter=2, display=1)
    _run(t)
    run = tmp_path / "run"
    before = sorted(p.name for p in run.iterdir())
    assert "latest.h5" in before and "metrics.jsonl" in before, before
    bad = tmp_path / "cut.h5"
    bad.write_bytes((run / "latest.h5").read_bytes()[:4096])
    for resume in (bad, tmp_path / "missing.h5"):
        with pytest.raises(UserError, match=f"checkpoint '{resume}'"):
            choose_run_dir("tiny", out=str(run), resume=str(resume), force=True)
        assert sorted(p.name for p in run.iterdir()) == before
    for init in (bad, tmp_path / "missing.h5", tmp_path / "missing.safetensors"):
        with pytest.raises(UserError, match=f"weights file '{init}'"):
            choose_run_dir("tiny", out=str(run), force=True, init=str(init))
        assert sorted(p.name for p in run.iterdir()) == before


def test_force_with_bad_data_or_a_bad_layer_deletes_nothing(tmp_path, digits_h5):
    """``--force`` deleted the folder's run before the graphs were built: a
    data file with a NaN, a test label out of range or a layer that does not
    fit was exit 2 after the deletion (only train.log and memory.json of
    the failed start-up left). Now the graphs are built on the data first
    (rundir.check_sources: replica.check_graphs), every file in place."""
    import h5py
    import numpy as np
    import pytest

    from purine_mpi.base.errors import UserError
    from purine_mpi.job.rundir import choose_run_dir
    _run(_trainer(tmp_path, digits_h5, max_iter=2, display=1))
    run = tmp_path / "run"
    before = sorted(p.name for p in run.iterdir())
    assert "latest.h5" in before and "metrics.jsonl" in before, before
    nan, labels = tmp_path / "nan.h5", tmp_path / "labels.h5"
    with h5py.File(digits_h5, "r") as f, h5py.File(nan, "w") as a, h5py.File(labels, "w") as b:
        for split in f:
            for key in f[split]:
                a[f"{split}/{key}"] = b[f"{split}/{key}"] = f[split][key][()]
        data = a["train/data"][()].astype(np.float32)
        data[5, 0, 0, 0] = np.nan
        del a["train/data"]
        a["train/data"] = data
        label = b["test/label"][()]
        label[3] = 11
        del b["test/label"]
        b["test/label"] = label
    cases = [({"data": {"train": {"path": str(nan)}}}, "non-finite values"),
             ({"data": {"test": {"path": str(labels)}}}, "holds label 11"),
             ({"net": {2: {"kernel": 20}}}, r"key 'net\[2\].kernel'")]
    for change, said in cases:
        cfg = small_net_config(str(digits_h5))
        for section, entries in change.items():
            for key, value in entries.items():
                cfg[section][key].update(value)
        with pytest.raises(UserError, match=said):
            choose_run_dir("tiny", out=str(run), force=True, job=make_job(cfg))
        assert sorted(p.name for p in run.iterdir()) == before, change
    # the command passes its job: exit 2 naming the file, nothing deleted
    cfg = small_net_config(str(digits_h5))
    cfg["data"]["train"]["path"] = str(nan)
    res = run_cli_args("train", write_config_file(tmp_path, cfg), "--out", run, "--force")
    assert res.returncode == 2 and "non-finite values" in res.stderr, res.stdout + res.stderr
    assert sorted(p.name for p in run.iterdir() if p.name != ".purine.lock") == before
    choose_run_dir("tiny", out=str(run), force=True, job=make_job(small_net_config(digits_h5)))
    assert "latest.h5" not in [p.name for p in run.iterdir()]  # a good job: deleted
