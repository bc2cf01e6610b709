"""Trust audit of the data pipeline: what the readers of real composed
graphs deliver, checked against NumPy written from docs/config.md ("Sample
order", the data keys), never against data/sources.py's own helpers.

Sample i of the file holds the pixels 100 i + 4 h + w (and the label i),
so a batch names its samples and shows any crop or flip. The split has 23 samples: no global batch below divides it.

On the code before this file (1822932):

- a data spec's ``seed`` did not seed its shuffle (the run's seed did):
  ``assert [4, 10, 5, 7, 0, 13, ...] == [12, 5, 21, 0, 22, 1, ...]``;
- ``predict`` under scheme tensor on 2 replicas x 2 shards wrote replica
  0's batch twice and never replica 1's: ``Arrays are not equal,
  Mismatched elements: 16 / 40``, rows 12..23 holding samples 0..11.
"""
import types

import h5py
import numpy as np
import pytest
import yaml

from purine_mpi.job.config import load_job
from purine_mpi.ops.data import DataReader
from purine_mpi.parallel.schemes import scheme_of
from purine_mpi.tools.graph import _OfflineWorld, composed

N = 23  # samples of the train split
N_TEST = 40
NET = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "h", "num_output": 8},
       {"type": "relu", "name": "act", "bottom": "h", "top": "h"},
       {"type": "fc", "name": "fc2", "bottom": "h", "top": "out", "num_output": 64},
       {"type": "softmax_loss", "name": "loss", "bottom": ["out", "label"], "top": "loss"}]
STAGES = {"fc1": 0, "act": 0, "fc2": 1, "loss": 1}


def images(n):
    """Sample i: 1 x 4 x 4 pixels 100 i + 4 h + w (``sample_ids`` reads i back)."""
    i, h, w = np.ogrid[:n, :4, :4]
    return (100 * i + 4 * h + w).astype(np.float32)[:, None]


def sample_ids(data):
    return (data[:, 0, 0, 0] // 100).astype(np.int64)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("trust_data") / "d.h5")
    with h5py.File(path, "w") as f:
        for split, n in (("train", N), ("test", N_TEST)):
            f.create_dataset(f"{split}/data", data=images(n))
            f.create_dataset(f"{split}/label", data=np.arange(n, dtype=np.int64))
    return path


def job_of(tmp_path, data_file, parallel, batch, shuffle=True, seed=5, data_seed=None,
           test_batch=None, transform=None):
    train = {"source": "hdf5", "path": data_file, "split": "train", "batch_size": batch,
             "shuffle": shuffle, **(transform or {})}
    if data_seed is not None:
        train["seed"] = data_seed
    data = {"train": train}
    if test_batch:
        data["test"] = {"source": "hdf5", "path": data_file, "split": "test",
                        "batch_size": test_batch, **(transform or {})}
    cfg = {"name": "trust_data", "seed": seed, "data": data, "net": NET,
           "solver": {"base_lr": 0.1, "max_iter": 10, "test_interval": 0},
           "parallel": parallel}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_job(str(path))


def readers(job, world, phase="train"):
    """[(rank, DataReader kernel)] of every rank's composed graph, each rank's
    readers in name order (micro-batch copy k: ``data@mb<k>``)."""
    out = []
    for r in range(world):
        graph, _ = composed(job, world, r, phase)
        ops = sorted((op for op in graph.ops.values() if op.op_type == "DataReader"),
                     key=lambda op: op.name)
        out += [(r, DataReader(op)) for op in ops]
    return out


def global_batches(job, world, samples):
    """(iterations, global batch) sample indices of the first iterations that
    read at least ``samples`` samples: each data replica's batch once
    (a tensor group's shards and a pipeline's stages read the same one), in
    replica order, micro-batch copies in copy order."""
    kernels = readers(job, world)
    g = kernels[0][1].batch_size * kernels[0][1].world_size
    rows = []
    for t in range(-(-samples // g)):
        parts = {}
        for _, k in kernels:
            key = (k.rank, k.world_size)
            got = sample_ids(k.prepare(t)[0])
            if key in parts:  # another shard of the same replica: the same batch
                np.testing.assert_array_equal(parts[key], got)
            parts[key] = got
        worlds = {w for _, w in parts}
        assert len(worlds) == 1 and sorted(r for r, _ in parts) == list(range(worlds.pop()))
        rows.append(np.concatenate([parts[key] for key in sorted(parts)]))
    return np.array(rows)


PARALLEL = [  # (parallel section, ranks, per-rank batch, data replicas)
    ({"scheme": "data"}, 2, 4, 2),
    ({"scheme": "data"}, 3, 4, 3),
    ({"scheme": "data", "micro_batches": 2}, 3, 4, 3),
    ({"scheme": "data", "mode": "sync_ps", "ps_ranks": 1}, 3, 4, 2),  # 2 workers
    ({"scheme": "pipeline", "stages": STAGES, "micro_batches": 2}, 2, 4, 1),
    ({"scheme": "hybrid", "stages": STAGES, "micro_batches": 2}, 4, 4, 2),
    ({"scheme": "tensor", "tensor_parallel": 2}, 4, 4, 2),  # 2 replicas x 2 shards
]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("parallel,world,batch,replicas", PARALLEL,
                         ids=[f"{p['scheme']}{p.get('mode', '')}{p.get('micro_batches', '')}-{w}"
                              for p, w, _, _ in PARALLEL])
def test_every_sample_once_per_epoch_and_the_one_rank_batch(tmp_path, data_file, parallel,
                                                            world, batch, replicas, shuffle):
    """Global position p of the run is sample order(p // n)[p % n]: each epoch
    (n consecutive positions, epochs crossing inside a batch) reads every
    sample exactly once, in file order without shuffle, and the global batch
    of t is the one rank's batch t of the same global size."""
    job = job_of(tmp_path, data_file, parallel, batch, shuffle)
    rows = global_batches(job, world, 3 * N)  # three epochs and a part
    g = rows.shape[1]
    assert g == replicas * batch
    got = rows.ravel()
    if not shuffle:
        np.testing.assert_array_equal(got, np.arange(len(got)) % N)
    for e in range(3):
        assert sorted(got[e * N:(e + 1) * N].tolist()) == list(range(N)), f"epoch {e}"
    if shuffle:
        assert not np.array_equal(got[:N], np.arange(N))
        assert not np.array_equal(got[:N], got[N:2 * N])  # a new order each epoch
    (tmp_path / "one").mkdir()
    one = job_of(tmp_path / "one", data_file, {"scheme": "data"}, g, shuffle)
    np.testing.assert_array_equal(global_batches(one, 1, 3 * N).ravel(), got)


@pytest.mark.parametrize("parallel,world,batch,replicas", PARALLEL,
                         ids=[f"{p['scheme']}{p.get('mode', '')}{p.get('micro_batches', '')}-{w}"
                              for p, w, _, _ in PARALLEL])
def test_test_phase_data_is_the_center_crop_unflipped(tmp_path, data_file, parallel, world,
                                                      batch, replicas):
    """crop_size 2 and mirror on both specs (docs/config.md: 'Testing crops the
    centre and never flips', Caffe's offset (H - crop) // 2): every test-graph
    reader of every rank gives each sample's pixels [1:3, 1:3] as they are;
    the train readers of the same spec crop elsewhere or flip some."""
    transform = {"crop_size": 2, "mirror": True}
    job = job_of(tmp_path, data_file, parallel, batch, test_batch=5, transform=transform)
    pixels = images(N_TEST)
    test_readers = readers(job, world, "test")
    assert test_readers
    for _, k in test_readers:
        assert k.attrs["train"] is False
        for t in range(3):
            data = k.prepare(t)[0]
            np.testing.assert_array_equal(data, pixels[sample_ids(data)][:, :, 1:3, 1:3])
    trained = [k.prepare(t)[0] for _, k in readers(job, world) for t in range(3)]
    assert any(not np.array_equal(d, images(N)[sample_ids(d)][:, :, 1:3, 1:3])
               for d in trained)


def test_a_data_specs_seed_orders_its_shuffle(tmp_path, data_file):
    """docs/config.md, data.*.seed: 'seed of the shuffle and of synthetic data'
    (default: the config's seed). The spec's seed 9 under run seed 5 shuffles
    as run seed 9 does; the run seed no longer matters then."""
    def first(run_seed, data_seed, sub):
        (tmp_path / sub).mkdir()
        job = job_of(tmp_path / sub, data_file, {"scheme": "data"}, 8, True, run_seed,
                     data_seed)
        (_, k), = readers(job, 1)
        return sample_ids(k.prepare(0)[0]).tolist()
    own = first(5, 9, "a")
    assert own == first(9, None, "b")
    assert own == first(6, 9, "c")
    assert own != first(5, 10, "d")
    assert first(5, None, "e") != own


def test_predict_writes_each_replicas_batch_in_sample_order_under_tensor(tmp_path, data_file):
    """``predict`` on 2 replicas x 2 tensor shards (4 ranks), run in one
    process: every rank's test reader of its composed graph, rank 0's
    gather as MPI's gather_object gives it. Row i must be test sample i
    (40 samples, 2 x 12 per iteration: the last iteration padded)."""
    from purine_mpi.tools import predict as predict_mod
    world = 4
    job = job_of(tmp_path, data_file, {"scheme": "tensor", "tensor_parallel": 2}, 4,
                 test_batch=12)
    graphs = [composed(job, world, r, "test")[0] for r in range(world)]
    kernels = [next(DataReader(op) for op in g.ops.values() if op.op_type == "DataReader")
               for g in graphs]
    layout = scheme_of(job).layout(job, _OfflineWorld(0, world))
    assert (layout.replicas, layout.tensor) == (2, 2)
    ws, batches = {}, []

    def run(i):
        batches[:] = [k.prepare(i) for k in kernels]
        ws["data"], ws["label"] = batches[0]

    dispatcher = types.SimpleNamespace(kernels={"data": kernels[0]}, workspace=ws, run=run)

    def gather_object(mine, root, what):
        return [mine] + [{"data": d, "label": lab} for d, lab in batches[1:]]

    trainer = types.SimpleNamespace(
        test=dispatcher, job=job, train=types.SimpleNamespace(drain=lambda: None, workspace=None),
        graphs=types.SimpleNamespace(pipeline=False, test_graph=graphs[0],
                                     data_size=layout.replicas, layout=layout, apart=False,
                                     test_data=(layout.replica, layout.replicas)),
        world=types.SimpleNamespace(size=world, rank=0, gather_object=gather_object))
    out = tmp_path / "preds.h5"
    res = predict_mod.predict(trainer, str(out), "w.h5", blobs=["data"])
    assert res["samples"] == N_TEST
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["label"][...], np.arange(N_TEST))
        np.testing.assert_array_equal(f["outputs/data"][...], images(N_TEST))
        np.testing.assert_array_equal(f["index"][...], np.arange(N_TEST))


def _loop(job, world, rank, kernels):
    """What Checkpoints.state_dict/load_state_dict read of a loop, for one
    rank of ``world`` (a one-rank world's gather)."""
    layout = scheme_of(job).layout(job, _OfflineWorld(rank, world))
    return types.SimpleNamespace(
        world=types.SimpleNamespace(rank=rank, size=world),
        graphs=types.SimpleNamespace(layout=layout),
        train=types.SimpleNamespace(kernels={k.op.name: k for k in kernels}),
        state=types.SimpleNamespace(window=None, watch=None, window_carry=None),
        log=lambda msg: None)


@pytest.mark.parametrize("after", [({"scheme": "data", "micro_batches": 2}, 3, 4),
                                   ({"scheme": "data"}, 2, 4),
                                   ({"scheme": "data"}, 1, 12)])
def test_a_resume_mid_epoch_reads_what_the_uninterrupted_run_reads(tmp_path, data_file, after):
    """A shuffled run of 3 ranks x 2 micro-batches x 4 (global 12) saves its
    readers' state after 5 iterations (60 samples, mid-epoch 3 of 23); the
    checkpoint's per-rank state is loaded as train/checkpoints.py loads it
    into the same layout, into 2 ranks x 4 (global 8: 60 rounds down to
    56) and into 1 rank x 12; from there every global batch is the
    uninterrupted run's samples at those positions."""
    from purine_mpi.train.checkpoints import Checkpoints
    before = job_of(tmp_path, data_file, {"scheme": "data", "micro_batches": 2}, 4)
    saved = readers(before, 3)
    for t in range(5):
        for _, k in saved:
            k.prepare(t)
            k.position += 1  # as run() leaves it
    ranks = {}
    for r, k in saved:
        ranks.setdefault(r, []).append(k)
    state = {"ranks": {str(r): {k.op.name: {"state": k.state_dict()} for k in ks}
                       for r, ks in ranks.items()},
             "layout": _loop(before, 3, 0, []).graphs.layout.as_dict()}
    parallel, world, batch = after
    (tmp_path / "after").mkdir()
    job = job_of(tmp_path / "after", data_file, parallel, batch)
    resumed = readers(job, world)
    for r in range(world):
        Checkpoints().load_state_dict(_loop(job, world, r, [k for q, k in resumed if q == r]),
                                      state, notes=False)
    start = 60 // (world * batch) * world * batch
    (tmp_path / "one").mkdir()
    one = job_of(tmp_path / "one", data_file, {"scheme": "data"}, 1)
    straight = global_batches(one, 1, start + 4 * world * batch).ravel()
    for t in range(4):
        got = np.concatenate([sample_ids(k.prepare(k.position + t)[0]) for _, k in resumed])
        g = world * batch
        np.testing.assert_array_equal(got, straight[start + t * g:start + (t + 1) * g])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_val_pass_predicts_each_token_at_most_once(tmp_path, world):
    """docs/formats.md, HDF5 text files: an unshuffled text split of n tokens
    is ⌊(n - 1) / T⌋ disjoint windows whose labels are tokens 1 .. ⌊(n - 1) / T⌋ T
    (each input shifted by one), the first and the last (n - 1) mod T
    tokens unpredicted; a one-pass read on 1-3 ranks with its padding
    dropped (positions >= the windows, evaluation's pass_counts) gives
    exactly those windows once, in order. The train split is the stream
    before the val split."""
    from purine_mpi.data.text import write_text
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(np.random.default_rng(0).integers(32, 127, 1000, dtype=np.uint8)))
    path = str(tmp_path / "t.h5")
    write_text(str(text), path, val_fraction=0.3)
    stream = np.frombuffer(text.read_bytes(), np.uint8)
    with h5py.File(path, "r") as f:
        train, val = f["train/tokens"][...], f["val/tokens"][...]
    np.testing.assert_array_equal(np.concatenate([train, val]), stream)
    assert len(val) == 300
    T, B = 16, 3
    spec = {"source": "text", "path": path, "split": "val", "sequence_length": T,
            "shuffle": False}
    windows = (len(val) - 1) // T  # 18: 288 tokens predicted, 11 not
    kernels = [DataReader(types.SimpleNamespace(name="data", attrs={
        "source": spec, "batch_size": B, "rank": r, "world_size": world, "seed": 0,
        "train": False})) for r in range(world)]
    data, labels = [], []
    for t in range(-(-windows // (B * world))):
        for r, k in enumerate(kernels):
            d, lab = k.prepare(t)
            first = (t * world + r) * B
            keep = max(0, min(B, windows - first))
            data.append(d[:keep])
            labels.append(lab[:keep])
    data, labels = np.concatenate(data), np.concatenate(labels)
    assert data.shape == labels.shape == (windows, T)
    np.testing.assert_array_equal(data.ravel(), val[:windows * T])
    np.testing.assert_array_equal(labels.ravel(), val[1:windows * T + 1])
    assert len(val) - 1 - windows * T == (len(val) - 1) % T == 11


@pytest.mark.mpi
def test_a_val_pass_of_token_data_gives_the_numpy_figures_on_1_2_3_ranks(tmp_path):
    """``test`` of a bigram net (embedding -> fc over the last axis -> token
    loss and accuracy) on the json package's byte tokens: the val split's
    1208 disjoint windows of 8 (not a multiple of 7 x 2 or 7 x 3: the last
    batch is padded) give the loss and accuracy NumPy computes in float64
    from the checkpoint over tokens 1 .. 1208 x 8, on 1, 2 and 3 ranks."""
    import json
    from tests.conftest import run_cli_args, run_mpi_cli, train_here, write_config_file
    from tests.gpt_nets import text_h5
    path, T = text_h5(tmp_path), 8
    data = {"source": "text", "path": path, "sequence_length": T}
    cfg = {"name": "bigram", "seed": 3,
           "data": {"train": dict(data, split="train", batch_size=4, shuffle=True),
                    "test": dict(data, split="val", batch_size=7, shuffle=False)},
           "net": [{"type": "embedding", "name": "wte", "bottom": "data", "top": "e",
                    "input_dim": 256, "num_output": 8},
                   {"type": "fc", "name": "head", "bottom": "e", "top": "logits",
                    "num_output": 256, "axis": -1},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"],
                    "top": "loss", "axis": -1},
                   {"type": "accuracy", "name": "acc", "bottom": ["logits", "label"],
                    "top": "acc", "axis": -1, "phase": "test"}],
           "solver": {"type": "sgd", "base_lr": 0.5, "max_iter": 5, "test_interval": 0,
                      "test_iter": None},
           "checkpoint": {"interval": 0}}
    config = write_config_file(tmp_path, cfg)
    weights = train_here(config, tmp_path / "run") / "latest.h5"
    with h5py.File(path, "r") as f:
        val = f["val/tokens"][...].astype(np.int64)
    with h5py.File(weights, "r") as f:
        emb, w, b = (f[f"params/{n}"][...].astype(np.float64)
                     for n in ("wte/weight", "head/weight", "head/bias"))
    windows = (len(val) - 1) // T
    assert windows == 1208
    x, y = val[:windows * T], val[1:windows * T + 1]
    z = emb[x] @ w.T + b
    z -= z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss, acc = -logp[np.arange(len(y)), y].mean(), (z.argmax(axis=1) == y).mean()
    for ranks in (1, 2, 3):
        res = (run_mpi_cli(ranks, "test", config, "--weights", weights) if ranks > 1 else
               run_cli_args("test", config, "--weights", weights))
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        assert got["samples"] == windows, (ranks, got)
        assert abs(got["loss"] - loss) < 2e-6 and abs(got["accuracy"] - acc) < 1e-6, \
            (ranks, got, loss, acc)
