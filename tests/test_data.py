"""Data sources, the data-parallel batching rule, the DataReader op and the
data set converters."""
import os
import pickle

import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.graph.core import Op
from purine_mpi.data.sources import EpochOrder, HDF5Source, SyntheticSource, hdf5_info
from purine_mpi.data.datasets import write_cifar10, write_digits
from purine_mpi.ops.data import DataReader
from tests.conftest import run_cli_here

N_TRAIN = 10


@pytest.fixture
def data_file(tmp_path):
    """/train: sample i is filled with the value i (so a batch names its samples)."""
    path = str(tmp_path / "d.h5")
    with h5py.File(path, "w") as f:
        for split, n in (("train", N_TRAIN), ("test", 3)):
            values = np.arange(n, dtype=np.float32)
            f.create_dataset(f"{split}/data", data=np.broadcast_to(
                values[:, None, None, None], (n, 2, 3, 3)).copy())
            f.create_dataset(f"{split}/label", data=np.arange(n, dtype=np.int64) % 4)
    return path



def test_hdf5_info_reads_a_file_once_and_again_when_it_changes(data_file, tmp_path, monkeypatch):
    """A start-up asks hdf5_info ~25 times of one file: the answer is read
    once (one h5py open), read again for a file rewritten or replaced, and
    an error is never kept (a file made after a miss is read)."""
    from purine_mpi.data import sources
    opened = []
    real = h5py.File
    monkeypatch.setattr(h5py, "File", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    assert hdf5_info(data_file, "train") == (N_TRAIN, (2, 3, 3))
    assert hdf5_info(data_file, "train") == (N_TRAIN, (2, 3, 3))
    assert hdf5_info(data_file, "test") == (3, (2, 3, 3))
    assert len(opened) == 2
    with real(data_file, "a") as f:  # rewritten in place: a new size and mtime
        del f["train/data"], f["train/label"]
        f.create_dataset("train/data", data=np.zeros((4, 1, 2, 2), np.float32))
        f.create_dataset("train/label", data=np.zeros(4, np.int64))
    os.utime(data_file, ns=(1, 1))  # even an mtime set back is another identity
    assert hdf5_info(data_file, "train") == (4, (1, 2, 2))
    later = str(tmp_path / "later.h5")
    with pytest.raises(UserError, match="not found"):
        hdf5_info(later, "train")
    os.replace(data_file, later)
    assert hdf5_info(later, "train") == (4, (1, 2, 2))
    assert len(opened) == 4
    # one answer kept per file and split (data/filecache.per_file_version):
    # the rewritten file's replaced its first one
    from purine_mpi.data import filecache
    readers = {sources._info_reader(s, False) for s in ("train", "test")}
    paths = {os.path.abspath(p) for p in (data_file, later)}
    assert len([slot for slot in filecache._CACHE
                if slot[0] in readers and slot[1] in paths]) == 3

def reader(spec, batch, rank=0, world=1, seed=0, name="data"):
    attrs = {"source": spec, "batch_size": batch, "rank": rank, "world_size": world,
             "seed": seed}
    return DataReader(Op(name, "DataReader", [], ["data", "label"], attrs))


def run_batches(kernel, count):
    """The next ``count`` batches of a kernel, through run() as the dispatcher calls it."""
    shapes = DataReader.infer(kernel.attrs, [])
    out = []
    for _ in range(count):
        outs = [np.empty(s, d) for s, d in shapes]
        kernel.run([], outs)
        out.append(outs)
    return out


def spec_of(path, shuffle=True):
    return {"source": "hdf5", "path": path, "split": "train", "shuffle": shuffle}


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_together_read_the_single_rank_batch(data_file, shuffle, world):
    batch, iters = 2, 6  # 6 iterations x up to 6 samples cross several epochs of 10
    spec = spec_of(data_file, shuffle)
    single = run_batches(reader(spec, world * batch, seed=7), iters)
    per_rank = [run_batches(reader(spec, batch, r, world, seed=7), iters) for r in range(world)]
    for t in range(iters):
        for k in (0, 1):  # data and label
            joined = np.concatenate([per_rank[r][t][k] for r in range(world)])
            np.testing.assert_array_equal(joined, single[t][k])


def test_epochs_are_permutations_and_seeded(data_file):
    order = EpochOrder(N_TRAIN, shuffle=True, seed=3)
    first = order.indices(0, 3 * N_TRAIN)
    for e in range(3):
        assert sorted(first[e * N_TRAIN:(e + 1) * N_TRAIN]) == list(range(N_TRAIN))
    assert not np.array_equal(first[:N_TRAIN], first[N_TRAIN:2 * N_TRAIN])
    np.testing.assert_array_equal(first, EpochOrder(N_TRAIN, True, seed=3).indices(0, 30))
    assert not np.array_equal(first, EpochOrder(N_TRAIN, True, seed=4).indices(0, 30))
    # file order without shuffle
    np.testing.assert_array_equal(EpochOrder(N_TRAIN, False).indices(8, 4), [8, 9, 0, 1])
    # the reader delivers those samples (data value == sample index)
    batches = run_batches(reader(spec_of(data_file), 5, seed=3), 6)
    seen = np.concatenate([b[0][:, 0, 0, 0] for b in batches]).astype(np.int64)
    np.testing.assert_array_equal(seen, first)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), first % 4)


def test_state_round_trip_and_reset(data_file):
    spec = spec_of(data_file)
    straight = run_batches(reader(spec, 3, seed=1), 7)
    first = reader(spec, 3, seed=1)
    run_batches(first, 4)  # leaves batch 4 prefetched
    state = first.state_dict()
    assert state["position"] == 4
    resumed = reader(spec, 3, seed=1)
    resumed.load_state_dict(state)
    for got, want in zip(run_batches(resumed, 3), straight[4:]):
        np.testing.assert_array_equal(got[0], want[0])
    first.reset_position(1)
    np.testing.assert_array_equal(run_batches(first, 1)[0][0], straight[1][0])
    # a run resumed on 3 ranks x 1 continues at the same sample count
    ranks = [reader(spec, 1, r, 3, seed=1) for r in range(3)]
    for k in ranks:
        k.load_state_dict(state)
    joined = np.concatenate([run_batches(k, 1)[0][0] for k in ranks])
    np.testing.assert_array_equal(joined, straight[4][0])


def test_prefetch_error_surfaces_in_run(data_file):
    kernel = reader(spec_of(data_file), 2)
    outs = [np.empty(s, d) for s, d in DataReader.infer(kernel.attrs, [])]
    kernel.run([], outs)  # loads the source; batch 1 is being prefetched

    def broken(indices):
        raise RuntimeError("disk on fire")
    kernel._source.gather = broken
    kernel.reset_position(5)  # drops the good prefetch, so the next one fails
    with pytest.raises(RuntimeError, match="disk on fire"):
        kernel.run([], outs)
    assert all(t.daemon for t in __import__("threading").enumerate()
               if t.name.startswith("prefetch:"))


def test_infer_reads_metadata_and_checks_files(data_file, tmp_path):
    attrs = {"source": spec_of(data_file), "batch_size": 4}
    assert DataReader.infer(attrs, []) == [((4, 2, 3, 3), "float32"), ((4,), "int64")]
    synthetic = {"source": {"source": "synthetic", "shape": [3, 5, 5], "classes": 2},
                 "batch_size": 2}
    assert DataReader.infer(synthetic, [])[0] == ((2, 3, 5, 5), "float32")
    with pytest.raises(UserError, match="not found"):
        DataReader.infer({"source": spec_of(str(tmp_path / "no.h5")), "batch_size": 1}, [])
    with pytest.raises(UserError, match="no group '/val'"):
        hdf5_info(data_file, "val")
    with pytest.raises(UserError, match="set the data spec's 'split'"):
        hdf5_info(data_file, None)


@pytest.mark.parametrize("data, label, match", [
    (np.zeros((4, 8), np.float32), np.zeros(4, np.int64), "must be 4-D float"),
    (np.zeros((4, 1, 2, 2), np.int32), np.zeros(4, np.int64), "must be 4-D float"),
    (np.zeros((4, 1, 2, 2), np.float32), np.zeros((4, 1), np.int64), "must be 1-D integer"),
    (np.zeros((4, 1, 2, 2), np.float32), np.zeros(3, np.int64), "has 4 samples"),
])
def test_bad_layouts_name_the_dataset(tmp_path, data, label, match):
    path = str(tmp_path / "bad.h5")
    with h5py.File(path, "w") as f:  # top-level layout: split None
        f["data"], f["label"] = data, label
    with pytest.raises(UserError, match=match) as info:
        HDF5Source(path)
    assert path in str(info.value)
    (tmp_path / "junk.h5").write_text("not hdf5")
    with pytest.raises(UserError, match="cannot be opened as HDF5"):
        HDF5Source(str(tmp_path / "junk.h5"))


def test_synthetic_is_deterministic_and_learnable():
    a = SyntheticSource([2, 3, 3], classes=3, num_samples=50, seed=5, split="train")
    b = SyntheticSource([2, 3, 3], classes=3, num_samples=50, seed=5, split="train")
    test = SyntheticSource([2, 3, 3], classes=3, num_samples=50, seed=5, split="test")
    idx = np.arange(50)
    np.testing.assert_array_equal(a.gather(idx)[0], b.gather(idx)[0])
    assert not np.array_equal(a.gather(idx)[0], test.gather(idx)[0])
    x, y = a.gather(idx)
    assert x.dtype == np.float32 and y.dtype == np.int64 and y.max() < 3
    # samples of a class sit around a shared center: nearest-center classifies well
    centers = np.stack([x[y == k].mean(0) for k in range(3)])
    xt, yt = test.gather(idx)
    guess = np.argmin(((xt[:, None] - centers[None]) ** 2).sum(axis=(2, 3, 4)), axis=1)
    assert (guess == yt).mean() > 0.8


def test_write_digits(tmp_path):
    path = str(tmp_path / "digits.h5")
    summary = write_digits(path)
    assert summary["train"] + summary["test"] == 1797 and summary["test"] == 360
    with h5py.File(path, "r") as f:
        assert f["train/data"].shape == (1437, 1, 8, 8) and f["train/data"].dtype == np.float32
        assert f["test/label"].shape == (360,) and f["test/label"].dtype == np.int64
        data = f["train/data"][...]
        assert 0.0 <= data.min() and data.max() <= 1.0
        assert sorted(set(f["test/label"][...])) == list(range(10))
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]
    assert HDF5Source(path, "test").n_samples == 360


def fake_cifar(directory, n=4, seed=0):
    rng = np.random.default_rng(seed)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"labels": list(rng.integers(0, 10, n)), b"batch_label": name.encode()}
        with open(directory / name, "wb") as f:
            pickle.dump(batch, f)
        batches[name] = batch
    return batches


def test_write_cifar10(tmp_path):
    src = tmp_path / "cifar-10-batches-py"
    src.mkdir()
    batches = fake_cifar(src)
    out = str(tmp_path / "cifar.h5")
    lines = []
    summary = write_cifar10(str(tmp_path), out, log=lines.append)  # finds the -py folder
    train_u8 = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    train_u8 = train_u8.reshape(-1, 3, 32, 32)
    mean = train_u8.astype(np.float64).mean(axis=(0, 2, 3))
    with h5py.File(out, "r") as f:
        assert f["train/data"].shape == (20, 3, 32, 32) and f["test/data"].shape == (4, 3, 32, 32)
        np.testing.assert_allclose(f.attrs["mean"], mean, rtol=1e-6)
        # the pixels as they are: uint8, chunked and compressed
        data = f["train/data"]
        assert data.dtype == np.uint8 and data.chunks is not None
        assert data.compression == "gzip" and data.chunks[1:] == (3, 32, 32)
        np.testing.assert_array_equal(data[...], train_u8)
        np.testing.assert_array_equal(f["test/label"][...], batches["test_batch"][b"labels"])
    assert f"read 20 training and 4 test images from {src}" in lines
    assert "wrote 20 train samples (uint8, 3x32x32)" in lines
    assert "wrote 4 test samples (uint8, 3x32x32)" in lines
    assert summary["train"] == 20
    (src / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(UserError, match="data_batch_3"):
        write_cifar10(str(src), str(tmp_path / "again.h5"))
    fake_cifar(src)
    (src / "test_batch").unlink()
    with pytest.raises(UserError, match="test_batch"):
        write_cifar10(str(src), str(tmp_path / "again.h5"))
    assert not (tmp_path / "again.h5").exists()


def test_cifar_pickle_runs_no_code(tmp_path):
    """A crafted batch whose pickle calls a global (here: creates a file)
    is refused with a UserError naming the file, and the call never happens."""
    src = tmp_path / "cifar-10-batches-py"
    src.mkdir()
    fake_cifar(src)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    with open(src / "data_batch_2", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": [0]}, f)
    with pytest.raises(UserError, match="data_batch_2.*posix.mkdir|data_batch_2.*os.mkdir"):
        write_cifar10(str(src), str(tmp_path / "out.h5"))
    assert not marker.exists()
    assert not (tmp_path / "out.h5").exists()


def test_cifar_pickle_cli_exit_2(tmp_path):
    src = tmp_path / "cifar-10-batches-py"
    src.mkdir()
    fake_cifar(src)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    with open(src / "test_batch", "wb") as f:
        pickle.dump(Evil(), f)
    res = run_cli_here("data", "cifar10", "--from", src, "--out", tmp_path / "out.h5")
    assert res.returncode == 2, res.stderr
    assert "test_batch" in res.stderr and "Traceback" not in res.stderr
    assert not marker.exists()


def test_synthetic_pool_smaller_than_the_samples_builds_block_by_block(monkeypatch):
    """A pool of fewer samples than ``num_samples`` (ImageNet-size samples),
    its last block short: each pool sample gets its own label's center, and a
    repeated sample keeps its pool sample's label (GoogLeNet's synthetic data
    once broke here: the last block read labels past the pool)."""
    from purine_mpi.data import sources
    sample = [3, 8, 8]
    nbytes = 4 * 3 * 8 * 8
    monkeypatch.setattr(sources, "SYNTHETIC_POOL_BYTES", 7 * nbytes)   # pool of 7
    monkeypatch.setattr(sources, "SYNTHETIC_BLOCK_BYTES", 3 * nbytes)  # blocks 3, 3, 1
    s = SyntheticSource(sample, classes=4, num_samples=20, seed=1, split="train")
    assert s.pool_size == 7 and s.labels.shape == (20,)
    centers = np.random.default_rng([1, 0x5EED]).standard_normal((4, *sample), dtype=np.float32)
    rng = np.random.default_rng([1, 0xDA7A, int.from_bytes(b"train".ljust(8, b"\0"), "little")])
    labels = rng.integers(0, 4, size=20, dtype=np.int64)
    noise = rng.standard_normal((7, *sample), dtype=np.float32)
    np.testing.assert_array_equal(s.pool, noise + centers[labels[:7]])
    x, y = s.gather(np.arange(20))
    np.testing.assert_array_equal(y, labels[np.arange(20) % 7])
    np.testing.assert_array_equal(x, s.pool[np.arange(20) % 7])


_EXIT_WITH_A_PREFETCH = """
import atexit, threading, time
alive = []
# registered before purine_mpi is imported: atexit runs it after the module's own handler
atexit.register(lambda: print("prefetch alive at exit:",
                              any(t.is_alive() for t in threading.enumerate()
                                  if t.name.startswith("prefetch:")), flush=True))
import numpy as np
from purine_mpi.graph.core import Op
from purine_mpi.ops.data import DataReader
attrs = {"source": {"source": "synthetic", "shape": [3, 5, 5], "classes": 2},
         "batch_size": 2}
k = DataReader(Op("data", "DataReader", [], ["data", "label"], attrs))
outs = [np.empty(s, d) for s, d in DataReader.infer(k.attrs, [])]
k.run([], outs)  # loads the source, starts the prefetch of batch 1
k.run([], outs)  # takes it, starts batch 2's
gather = k._source.gather
k._source.gather = lambda idx: (time.sleep(1.0), gather(idx))[1]  # a slow file
k.reset_position(7)
k.run([], outs)  # batch 7 (slow), then batch 8's prefetch (slow) is in flight at exit
"""


def test_the_prefetch_in_flight_ends_before_the_interpreter(tmp_path):
    """Every run ends with the next batch being prefetched by a daemon
    thread. Still inside NumPy when the interpreter finalised, it was ended
    by pthread_exit, whose forced unwinding through NumPy's C++ frames
    aborted a finished `bench` once in a whole-suite run ("terminate
    called without an active exception"). An atexit handler now lets the
    batch finish and ends the thread first."""
    import subprocess
    import sys

    from tests.conftest import cli_env
    res = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_PREFETCH], capture_output=True,
                         text=True, env=cli_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    assert "prefetch alive at exit: False" in res.stdout, (res.stdout, res.stderr)


@pytest.mark.parametrize("dispatcher", ["serial", "event"])
def test_closing_a_dispatcher_ends_its_readers_prefetch_and_frees_its_workspace(dispatcher):
    """A dispatcher's close ends its data readers' prefetch threads (the
    batch in flight finished), so nothing keeps the closed run's workspace:
    each prefetch thread holds its reader, which holds the workspace
    (``k.workspace``, ``k.ins``/``k.outs``). Left to end ``IDLE_S`` after
    its last request, the thread kept every blob of the run in use -- on a
    GPU the whole device arena, counted in the peak of the next run in the
    process (issue 45: benchmarks/gpt_gpu.py's second side of ours read
    about twice the first's peak). Fails before: the workspace outlives
    close (the weak reference still resolves) and the thread is alive."""
    import gc
    import threading
    import weakref

    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.runtime.dispatcher import EventDispatcher, SerialDispatcher
    from tests.conftest import make_job
    from tests.emulated_gpu.helpers import init_params, tiny_config
    graph, _ = build_train_graph(make_job(tiny_config()))
    before = {t for t in threading.enumerate() if t.name.startswith("prefetch:")}
    d = (SerialDispatcher if dispatcher == "serial" else EventDispatcher)(graph, seed=3)
    init_params(d.workspace, graph, 5)
    d.workspace["iter"][...] = 0
    d.run(0)   # ends with the next batch being prefetched
    readers = [t for t in threading.enumerate()
               if t.name.startswith("prefetch:") and t not in before]
    assert readers, "no prefetch thread: the case is not run"
    ws = weakref.ref(d.workspace)
    d.close()
    assert not any(t.is_alive() for t in readers)
    del d, graph
    gc.collect()
    assert ws() is None, [type(r).__name__ for r in gc.get_referrers(ws())]


def _blocking_gather(kernel):
    """Make ``kernel``'s source gather wait for the returned event."""
    import threading
    gate, real = threading.Event(), kernel._source.gather

    def gather(indices):
        gate.wait(30)
        return real(indices)
    kernel._source.gather = gather
    return gate


def test_a_reader_whose_stop_timed_out_still_serves_what_is_asked_after(data_file):
    """A stop that times out (the batch in flight takes longer than the
    wait: a dispatcher's close, EXIT_WAIT_S; a close called twice) leaves
    its end-of-thread marker queued behind that batch; a request queued
    after it must still be served, by that thread or a new one. Fails
    before: the thread ended at the marker with the request still queued,
    and no thread was started for it (the old one was still alive when it
    came), so the reader waited for it for ever."""
    kernel = reader(spec_of(data_file), 2)
    outs = [np.empty(s, d) for s, d in DataReader.infer(kernel.attrs, [])]
    kernel.run([], outs)                     # batch 1 being prefetched
    assert kernel._pending[1]["done"].wait(30)
    gate = _blocking_gather(kernel)
    kernel._start(5)                         # in flight, held in the gather
    kernel.stop_prefetch(0.05)               # times out: the marker is queued
    kernel.stop_prefetch(0.05)               # a second close: a second marker
    kernel._start(7)                         # the reader used again
    gate.set()
    assert kernel._pending[1]["done"].wait(10), "the request after the stop was never served"
    kernel.stop_prefetch(30)
    assert kernel._worker is None


def test_closing_with_several_readers_in_flight_waits_exit_wait_s_in_all(data_file,
                                                                         monkeypatch):
    """A dispatcher's close waits for its readers' batches in flight under
    one deadline (ops/data.EXIT_WAIT_S in all, as at the interpreter's
    exit), not that long for each reader in turn. Fails before: three
    readers held in their gathers took three times the wait."""
    import time
    import types

    from purine_mpi.ops import data as data_ops
    from purine_mpi.runtime.dispatcher import Dispatcher
    monkeypatch.setattr(data_ops, "EXIT_WAIT_S", 1.0)
    kernels, gates = {}, []
    for i in range(3):
        k = reader(spec_of(data_file), 2, seed=i, name=f"data{i}")   # a source each
        outs = [np.empty(s, d) for s, d in DataReader.infer(k.attrs, [])]
        k.run([], outs)
        assert k._pending[1]["done"].wait(30)
        gates.append(_blocking_gather(k))
        k._start(5)                          # in flight, held
        kernels[k.op.name] = k
    t0 = time.monotonic()
    try:
        Dispatcher._stop_prefetch(types.SimpleNamespace(kernels=kernels))
        elapsed = time.monotonic() - t0
    finally:
        for gate in gates:
            gate.set()
    assert elapsed < 2.2, f"close waited {elapsed:.2f} s for 3 readers (EXIT_WAIT_S 1.0)"
    for k in kernels.values():
        k.stop_prefetch(30)
        assert k._worker is None
