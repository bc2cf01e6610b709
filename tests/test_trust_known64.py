"""Four results that looked good and were not (trust audit, session 64):

- ``export onnx`` of a ``precision: bf16`` config wrote the float32 model
  without a word: its outputs are not the bf16 forward's. Now one note on
  stderr and the metadata property ``purine.precision`` say so.
- the start-up block's ``parameters`` counted batch norm's running
  statistics as parameters; now the trained ones, the rest apart.
- shared data sources (and the in-memory HDF5 splits) were keyed by the
  file's stat fields: on a file system with coarse timestamps a same-size
  rewrite within one tick kept the key and the old data was read; now a
  file changed within ``RACY_SECONDS`` is keyed by its content's digest.
- a text data file written before ``data text`` turned a tokenizer's
  truncation and padding off was refused beside a new file of the same
  tokenizer (the digests of the stored JSON differed).
All in-process and small."""
import json
import os
import time

import numpy as np
import pytest

from purine_mpi.base.errors import UserError

from .conftest import (run_cli_args, run_cli_here, small_net_config, train_here,
                       write_config_file)


# ------------------------------------------------------ (a) export of bf16
def test_export_onnx_of_a_bf16_config_says_the_model_is_float32(tmp_path, digits_h5):
    onnx = pytest.importorskip("onnx")
    cfg = small_net_config(digits_h5)
    cfg["solver"]["max_iter"] = 1
    weights = train_here(cfg, tmp_path / "run") / "latest.h5"
    fp32 = write_config_file(tmp_path, cfg, "fp32.yaml")
    res = run_cli_here("export", "onnx", fp32, "--weights", weights, "--out", tmp_path / "a.onnx")
    assert res.returncode == 0, res.stderr
    assert "precision" not in res.stderr, res.stderr  # an fp32 config: nothing to say
    keys = [p.key for p in onnx.load(str(tmp_path / "a.onnx")).metadata_props]
    assert "purine.precision" not in keys
    bf16 = write_config_file(tmp_path, dict(cfg, device=0, precision="bf16"), "bf16.yaml")
    res = run_cli_here("export", "onnx", bf16, "--weights", weights, "--out", tmp_path / "b.onnx")
    assert res.returncode == 0, res.stderr  # written, not refused
    notes = [line for line in res.stderr.splitlines() if "bf16" in line]
    assert len(notes) == 1 and notes[0].startswith("note: precision is bf16"), res.stderr
    assert "float32" in notes[0] and "not those of the bf16 forward" in notes[0], notes
    assert "wrote" in res.stdout and "note" not in res.stdout, res.stdout
    props = {p.key: p.value for p in onnx.load(str(tmp_path / "b.onnx")).metadata_props}
    said = json.loads(props["purine.precision"])
    assert said["trained"] == "bf16" and said["model"] == "float32", said


# ------------------------------------------- (b) parameters: trained only
def test_startup_parameters_leave_the_running_statistics_apart(tmp_path, digits_h5):
    cfg = small_net_config(digits_h5)
    cfg["solver"]["max_iter"] = 1
    cfg["net"].insert(1, {"type": "batch_norm", "name": "bn1", "bottom": "conv1",
                          "top": "conv1"})
    lines = []
    train_here(cfg, tmp_path / "run", lines=lines)
    row = next(line for line in lines if line.startswith("  parameters"))
    # conv1 1->4 3x3 (36 + 4), bn1 scale and shift (4 + 4), fc1 64->10 (640 + 10)
    trained = 36 + 4 + 4 + 4 + 640 + 10
    assert row.split(None, 1)[1] == (f"{trained:,} in 6 blobs (2.7 KiB, float32); not trained: "
                                     "8 in 2 blobs (32 B: running statistics)"), row


def test_gpt_closed_form_counts_no_running_statistics():
    """bench --json's PaLM closed form: N is the parameters, not a batch
    norm's running statistics."""
    from purine_mpi.graph import Graph
    from purine_mpi.tools.flops import gpt_figures
    g = Graph("g")
    g.add_blob("qkv", (2, 5, 24))
    g.add_blob("w", (8, 8), kind="param")
    g.add_blob("bn/running_mean", (100,), kind="param", attrs={"learnable": False})
    g.add_op("a", "Attention", ["qkv"], ["o"], {"num_heads": 2})
    n, layers, width, t = gpt_figures(g)
    assert (n, layers, width, t) == (64, 1, 8, 5)


# --------------------------------------------- (c) coarse file timestamps
@pytest.fixture
def coarse_clock(monkeypatch):
    """``os.stat`` of the files named in the returned set reports one fixed
    mtime and ctime (now): a file system whose timestamps did not tick
    between two writes."""
    from purine_mpi.data import filecache
    # the frozen times stay racy however slow the machine (past 10 s the
    # file would be keyed by its frozen stat fields alone: a false failure)
    monkeypatch.setattr(filecache, "RACY_SECONDS", 3600)
    real, frozen, names = os.stat, time.time_ns(), set()

    class Coarse:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, name):
            return getattr(self._st, name)
        st_mtime_ns = st_ctime_ns = frozen
        st_mtime = st_ctime = frozen / 1e9

    def stat(path, *args, **kwargs):
        st = real(path, *args, **kwargs)
        return Coarse(st) if os.fspath(path) in names else st
    monkeypatch.setattr(os, "stat", stat)
    return names


def test_a_same_size_rewrite_within_one_tick_is_read_again(tmp_path, coarse_clock):
    import h5py

    from purine_mpi.data.sources import HDF5Source, shared_source
    path = str(tmp_path / "d.h5")
    coarse_clock.add(path)

    def write(value):
        with h5py.File(path, "w") as f:
            f.create_dataset("train/data", data=np.full((6, 1, 2, 2), value, np.float32))
            f.create_dataset("train/label", data=np.arange(6) % 2)
    write(1.0)
    spec = {"source": "hdf5", "path": path, "split": "train"}
    old = shared_source(spec, 0)
    first = os.stat(path)
    write(2.0)
    again = os.stat(path)
    assert (first.st_size, first.st_mtime_ns, first.st_ctime_ns) == \
        (again.st_size, again.st_mtime_ns, again.st_ctime_ns)  # the stat fields kept
    fresh = shared_source(spec, 0)
    assert fresh is not old, "a stale source was shared for the rewritten file"
    assert fresh.source.gather([0])[0][0, 0, 0, 0] == 2.0
    assert old.source.gather([0])[0][0, 0, 0, 0] == 1.0  # read into memory before
    # the in-memory split cache of a new HDF5Source: the new values too
    assert HDF5Source(path, "train").gather([0])[0][0, 0, 0, 0] == 2.0


def test_an_old_file_is_not_hashed(tmp_path, monkeypatch):
    """The digest is only for a racy file: one changed more than
    RACY_SECONDS ago is keyed by its stat fields alone (no read)."""
    from purine_mpi.data import filecache
    path = tmp_path / "x.bin"
    path.write_bytes(b"abc")
    assert filecache.file_identity(str(path))[-1] == filecache.content_digest(str(path))
    assert filecache.file_identity(str(path), digest=False)[-1] == filecache.RACY
    assert filecache.file_identity(str(path), digest=2)[-1] == filecache.RACY  # over 2 bytes
    assert filecache.file_identity(str(path), digest=3)[-1] == filecache.content_digest(
        str(path))
    later = time.time_ns() + (filecache.RACY_SECONDS + 1) * 10**9
    monkeypatch.setattr(filecache, "content_digest", lambda p: pytest.fail("hashed"))
    assert filecache.file_identity(str(path), now_ns=later)[-1] is None


# ------------------------------------- (d) a tokenizer saved before the fix
def test_an_old_files_truncation_and_padding_do_not_make_another_vocabulary(tmp_path):
    pytest.importorskip("tokenizers")
    import h5py

    from purine_mpi.data.text import shared_vocabulary
    from purine_mpi.data.tokenizer import DATASET, train_bpe, write_json
    text = "".join(f"def f{i}(x):\n    return x * {i} + 1\n" for i in range(100))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(text)
    tok = train_bpe([text], 300)
    tok.save(str(tmp_path / "tok.json"))
    for name in ("new", "old"):
        res = run_cli_here("data", "text", "--from", src, "--tokenizer", tmp_path / "tok.json",
                           "--out", tmp_path / f"{name}.h5")
        assert res.returncode == 0, res.stderr
    # the file as data text wrote it before the fix: the JSON with both on
    tok.enable_truncation(max_length=64)
    tok.enable_padding(length=128, pad_id=0, pad_token="!")
    with h5py.File(tmp_path / "old.h5", "a") as f:
        del f[DATASET]
        write_json(f, tok.to_str())
    paths = [("data.train.path", str(tmp_path / "new.h5")),
             ("data.test.path", str(tmp_path / "old.h5"))]
    got = shared_vocabulary(paths)
    assert json.loads(got)["model"] == json.loads(tok.to_str())["model"]
    # the old file first: the JSON a run keeps (its checkpoints, export hf's
    # tokenizer.json, which Hugging Face applies) has neither, as it encodes
    from tokenizers import Tokenizer
    got = shared_vocabulary(paths[::-1])
    assert json.loads(got)["model"] == json.loads(tok.to_str())["model"]
    loaded = Tokenizer.from_str(got)
    assert loaded.truncation is None and loaded.padding is None
    # another tokenizer is still refused
    other = train_bpe([text], 280)
    with h5py.File(tmp_path / "old.h5", "a") as f:
        del f[DATASET]
        write_json(f, other.to_str())
    with pytest.raises(UserError, match="disagree on the vocabulary"):
        shared_vocabulary(paths)


def test_a_large_racy_file_is_neither_hashed_nor_waited_for(tmp_path, monkeypatch):
    """A racy file over HASH_BYTES is not read whole, and start-up does not
    wait for it to age (the earlier fix slept up to RACY_SECONDS: a run
    started right after `data` wrote a 300 MB file started ~10 s later):
    its stat fields key it, as an older file's; a small racy file is still
    hashed."""
    from purine_mpi.data import filecache
    path = tmp_path / "big.bin"
    path.write_bytes(b"x" * 100)
    monkeypatch.setattr(filecache.time, "sleep", lambda s: pytest.fail(f"slept {s} s"))
    monkeypatch.setattr(filecache, "HASH_BYTES", 10)
    monkeypatch.setattr(filecache, "content_digest", lambda p: pytest.fail("hashed"))
    ident = filecache.file_identity(str(path))
    assert ident[-1] is None
    monkeypatch.setattr(filecache, "HASH_BYTES", 1000)
    monkeypatch.setattr(filecache, "content_digest", lambda p: "d")
    assert filecache.file_identity(str(path))[-1] == "d"


def test_a_just_written_file_is_hashed_once_per_load_not_per_look(tmp_path, digits_h5,
                                                                  monkeypatch):
    """A start-up on a just-written data file hashed it whole at every look:
    each op's shapes, the plan, the notes (hdf5_info: a header, whose
    reading costs less than hashing a file over 1 MiB), each loss and
    accuracy's label check, each shared source twice. 42 digests of a
    60 MB file on rank 0 of a 2-rank train (8 s of a 6 s set-up, against
    0.3 s for an old file). Now: one digest per load of the data, a label
    check per data spec and a shared source."""
    import h5py

    from purine_mpi.data import filecache
    monkeypatch.setattr(filecache, "RACY_SECONDS", 3600)  # racy however slow the machine
    path = tmp_path / "fresh.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:  # 1.5 MiB: over a header's digest limit
        for split, n in (("train", 6000), ("test", 120)):
            f[f"{split}/data"] = rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
            f[f"{split}/label"] = rng.integers(0, 10, n)
    hashed = []
    real = filecache.content_digest
    monkeypatch.setattr(filecache, "content_digest", lambda p: hashed.append(p) or real(p))
    cfg = small_net_config(str(path))
    cfg["solver"]["max_iter"] = 1
    train_here(cfg, tmp_path / "run")
    # two data specs (train, test): each checked once (its labels) and
    # shared once (its readers' source)
    assert len(hashed) <= 4, f"the data file was hashed {len(hashed)} times at start-up"


def test_an_unchanged_file_is_loaded_once_across_its_racy_window(tmp_path, monkeypatch):
    """A split loaded while its file was racy (keyed by its digest) and
    asked for again once the file is RACY_SECONDS old (keyed by its stat
    fields) was loaded a second time and both copies kept for the process
    (HDF5Source's cache never lets go): a start-up whose label check came
    before the 10 s and whose readers came after held the data twice. Now
    the digest, taken once more, says it is the same version."""
    import h5py

    from purine_mpi.data import filecache
    from purine_mpi.data.sources import HDF5Source
    path = str(tmp_path / "d.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("train/data", data=np.arange(24, dtype=np.float32).reshape(6, 1, 2, 2))
        f.create_dataset("train/label", data=np.arange(6) % 2)
    clock = {"now": time.time_ns()}

    class Clock:
        @staticmethod
        def time_ns():
            return clock["now"]
        sleep = staticmethod(time.sleep)
    monkeypatch.setattr(filecache, "time", Clock)
    loads = []
    real = HDF5Source._load
    monkeypatch.setattr(HDF5Source, "_load", lambda self: loads.append(1) or real(self))
    first = HDF5Source(path, "train")  # racy: keyed by the file's digest
    assert filecache.file_identity(path)[-1] is not None
    clock["now"] += (filecache.RACY_SECONDS + 1) * 10**9
    assert filecache.file_identity(path)[-1] is None  # no longer racy
    again = HDF5Source(path, "train")
    assert len(loads) == 1 and again.data is first.data, "an unchanged split was loaded twice"
    # a rewrite within the window is still read again (same size, new values)
    with h5py.File(path, "r+") as f:
        f["train/data"][0, 0, 0, 0] = -1.0
    clock["now"] = time.time_ns()
    fresh = HDF5Source(path, "train")
    assert fresh.gather([0])[0][0, 0, 0, 0] == -1.0 and len(loads) == 2


def test_plan_resume_counts_no_solver_state_for_running_statistics(tmp_path, digits_h5):
    """``plan --resume``'s checkpoint (tools/plan.own_checkpoint_bytes)
    counted solver state for every parameter blob, a batch norm's running
    statistics too, which have none: it equals a real checkpoint's arrays
    now (AdamW: m and v for the trained parameters only)."""
    from purine_mpi.job.checkpoint_file import load_checkpoint
    from purine_mpi.job.config import load_job
    from purine_mpi.parallel.rank_graphs import build_rank_graphs
    from purine_mpi.tools.plan import arrays_nbytes, own_checkpoint_bytes
    from purine_mpi.tools.graph import _OfflineWorld
    cfg = small_net_config(digits_h5)
    cfg["solver"] = {"type": "adamw", "base_lr": 0.001, "max_iter": 1}
    cfg["net"].insert(1, {"type": "batch_norm", "name": "bn1", "bottom": "conv1",
                          "top": "conv1"})
    run = train_here(cfg, tmp_path / "run")
    saved = arrays_nbytes(load_checkpoint(run / "latest.h5"))
    job = load_job(write_config_file(tmp_path, cfg, "bn.yaml"))
    graphs = build_rank_graphs(job, _OfflineWorld(0, 1))
    params = arrays_nbytes(load_checkpoint(run / "latest.h5").params)
    assert own_checkpoint_bytes(job, graphs) == saved, (saved, params)


def test_export_hf_of_a_bf16_config_says_the_model_is_float32(tmp_path):
    """``export hf`` of a bf16 config wrote the float32 master weights
    without the note ``export onnx`` gives (stop 64's left-open item)."""
    pytest.importorskip("safetensors.numpy")
    from .gpt_nets import gpt_config, text_h5
    cfg = gpt_config(text_h5(tmp_path), layers=1, iters=1)
    weights = train_here(write_config_file(tmp_path, cfg), tmp_path / "run") / "latest.h5"
    fp32 = run_cli_here("export", "hf", write_config_file(tmp_path, cfg, "fp32.yaml"),
                        "--weights", weights, "--out", tmp_path / "a")
    assert fp32.returncode == 0 and "precision" not in fp32.stderr, fp32.stderr
    bf16 = write_config_file(tmp_path, dict(cfg, device=0, precision="bf16"), "bf16.yaml")
    res = run_cli_here("export", "hf", bf16, "--weights", weights, "--out", tmp_path / "b")
    assert res.returncode == 0, res.stderr  # written, not refused
    notes = [line for line in res.stderr.splitlines() if line.startswith("note: precision")]
    assert len(notes) == 1 and "not those of the bf16 forward" in notes[0], res.stderr


def test_plan_init_of_a_data_file_is_refused_as_train_refuses_it(tmp_path, digits_h5):
    """``plan --init DATA.h5`` (a data file, no /params) said the job fits
    and exited 0, where ``train --init DATA.h5`` exits 2."""
    cfg = small_net_config(digits_h5)
    path = write_config_file(tmp_path, cfg)
    res = run_cli_here("plan", path, "--init", digits_h5)
    assert res.returncode == 2, (res.returncode, res.stdout[-400:], res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no /params group" in lines[0], res.stderr


def test_resume_auto_without_a_checkpoint_names_the_init_weights(tmp_path, digits_h5):
    """``train --init W --resume auto`` in a folder without a checkpoint said
    "starting from scratch" and then loaded W."""
    cfg = small_net_config(digits_h5)
    cfg["solver"]["max_iter"] = 1
    weights = train_here(cfg, tmp_path / "first") / "latest.h5"
    path = write_config_file(tmp_path, cfg)
    res = run_cli_args("train", path, "--init", weights, "--resume", "auto",
                       "--out", tmp_path / "second")
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stdout.splitlines() if line.startswith("no checkpoint in")]
    assert len(said) == 1 and "starting from the --init weights" in said[0] and \
        "scratch" not in said[0], res.stdout[-800:]
