"""Issue 36 "Everyday habits", items 7, 8, 10 and 11.

- 11: LRN WITHIN_CHANNEL (Caffe's spatial LRN: an average of squares over a
  local_size x local_size window) against a NumPy reference, PyTorch's
  avg_pool2d composition, finite differences, the GPU branch on the emulated
  device (no allocation), the ONNX export, and Caffe's own cifar10_full
  (prototxt and solver as Caffe ships them) converted from a Caffe tree with
  its LMDBs and mean file, then trained.
- 10: the DOT graph draws gradient buckets with 'view' edges: no blob alone.
- 7: `data cifar10 --from` takes the .tar.gz, its folder or the unpacked
  folder (unpacked safely); a failed download leaves nothing behind.
- 8: `predict --calibrate` on one host says it measured shared memory.
Each test fails on 5a26a28 (the unpacked-folder and --np 1 parameters are
the unchanged behaviour, kept as guards).
"""
import os
import re
import shutil

import numpy as np
import pytest

from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class

from .conftest import REPO, cli_env, make_job, run_cli_args, run_cli_here
from .lmdb_fixtures import write_lmdb, write_mean
from .opcheck import numeric_grad, run_op
from .test_caffe_convert import fixture

WITHIN = {"local_size": 3, "alpha": 0.7, "beta": 0.75, "k": 1.0, "norm_region": "within_channel"}


def _rand(shape, seed=0, scale=1.0, dtype=np.float64):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)


def lrn_within_reference(x, size, alpha, beta, k):
    """Caffe's WITHIN_CHANNEL, written out as loops over the window: scale =
    k + alpha * (sum of x^2 over the size x size window, zeros past the
    edges) / size^2; y = x * scale^-beta."""
    r = size // 2
    n, c, h, w = x.shape
    scale = np.empty_like(x)
    for i in range(h):
        for j in range(w):
            win = x[:, :, max(0, i - r):i + r + 1, max(0, j - r):j + r + 1]
            scale[:, :, i, j] = k + alpha * (win ** 2).sum(axis=(2, 3)) / (size * size)
    return x * scale ** -beta, scale


@pytest.mark.parametrize("shape,attrs", [
    ((2, 3, 5, 4), WITHIN),
    ((1, 2, 6, 7), dict(WITHIN, local_size=5, alpha=2.0, beta=0.5, k=2.0)),
    ((2, 2, 2, 3), dict(WITHIN, local_size=7)),              # window wider than the plane
])
def test_case11_lrn_within_channel_matches_numpy_and_torch(shape, attrs):
    """Case 11: values against the NumPy reference; values and gradients
    against PyTorch's avg_pool2d composition (Caffe's definition)."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = _rand(shape, scale=2.0)
    outs, grads = run_op("LRN", attrs, {"x": x}, wrt=["x"])
    size, alpha, beta, k = attrs["local_size"], attrs["alpha"], attrs["beta"], attrs["k"]
    y_ref, scale_ref = lrn_within_reference(x, size, alpha, beta, k)
    np.testing.assert_allclose(outs[0], y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(outs[1], scale_ref, rtol=1e-12, atol=1e-12)
    t = torch.tensor(x, requires_grad=True)
    avg = F.avg_pool2d(t * t, size, 1, size // 2, count_include_pad=True)
    y = t * (k + alpha * avg) ** -beta
    (y * torch.tensor(outs["_loss_weights"][0])).sum().backward()
    np.testing.assert_allclose(outs[0], y.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads["x"], t.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_case11_lrn_within_channel_numeric_grad():
    """Case 11: the gradient against central differences."""
    x, weight = _rand((2, 2, 4, 5)), _rand((2, 2, 4, 5), seed=1)
    attrs = dict(WITHIN, alpha=0.9, k=1.5)
    _, grads = run_op("LRN", attrs, {"x": x}, wrt=["x"], loss_weights=[weight, None])
    np.testing.assert_allclose(grads["x"],
                               numeric_grad("LRN", attrs, {"x": x}, "x", [weight, None]),
                               rtol=1e-6, atol=1e-8)


def test_case11_lrn_within_channel_needs_four_axes():
    """Case 11: a 2-axis input is refused at build time, naming the axes."""
    from purine_mpi.base.errors import ShapeError
    with pytest.raises(ShapeError, match="4 axes"):
        run_op("LRN", WITHIN, {"x": _rand((3, 4))})


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_case11_lrn_within_channel_gpu_branch_allocates_nothing(host_build_dir, monkeypatch,
                                                                dtype):
    """Case 11: on the emulated device the forward and backward give the
    NumPy path's values and, once their scratch exists, allocate nothing
    (every result goes through out= into outputs and temporaries)."""
    import purine_mpi.gpu as gpu
    from tests.emulated_gpu import Allocations, DeviceArray, use_emulated_cupy
    x, dy = _rand((2, 3, 6, 5), dtype=dtype), _rand((2, 3, 6, 5), seed=1, dtype=dtype)

    def run(op_type, inputs, dev):
        kernel = get_kernel_class(op_type)(Op("probe", op_type, [], [], dict(WITHIN)))
        ins = [dev(a) for a in inputs]
        outs = [dev(np.full(x.shape, np.nan, dtype)) for _ in range(2 if op_type == "LRN" else 1)]
        kernel.run(ins, outs)
        Allocations.log, Allocations.counting = [], True
        try:
            kernel.run(ins, outs)
        finally:
            Allocations.counting = False
        return [np.array(o) for o in outs], list(Allocations.log)

    host = lambda a: a  # noqa: E731
    (y, scale), _ = run("LRN", [x], host)
    (dx,), _ = run("LRNGrad", [dy, x, y, scale], host)
    use_emulated_cupy(monkeypatch, host_build_dir)
    try:
        to_dev = lambda a: np.array(a).view(DeviceArray)  # noqa: E731
        (gy, gscale), log_f = run("LRN", [x], to_dev)
        (gdx,), log_b = run("LRNGrad", [dy, x, y, scale], to_dev)
    finally:
        gpu.clear_kernel_cache()
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-5, atol=2e-5)
    for got, want in ((gy, y), (gscale, scale), (gdx, dx)):
        np.testing.assert_allclose(got, want, **tol)
    assert log_f == [] and log_b == [], (log_f, log_b)


def test_case11_lrn_within_channel_captures_in_a_cuda_graph(host_build_dir, monkeypatch):
    """Case 11: cifar10_quick with Caffe's cifar10_full norms (within-channel
    LRNs after pool1 and pool2), placed and fused on the emulated device
    that refuses what CuPy refuses in a capture: captured whole, one launch
    per steady-state iteration, and the same weights, bit for bit, as the
    eager stream dispatcher."""
    import purine_mpi.gpu as gpu
    from purine_mpi.parallel.placement import add_loss_watch, prepare_for_device
    from purine_mpi.job.replica import build_train_graph, loss_blobs
    from purine_mpi.runtime.factory import make_dispatcher
    from tests.emulated_gpu import SimulatedRuntime, init_params, use_emulated_cupy
    from tests.emulated_gpu import net_config
    use_emulated_cupy(monkeypatch, host_build_dir)
    config = net_config("cifar10_quick", 2)
    net = []
    for entry in config["net"]:
        entry = dict(entry)
        if entry["name"] in ("conv2", "conv3"):
            entry["bottom"] = {"conv2": "norm1", "conv3": "norm2"}[entry["name"]]
        net.append(entry)
        if entry["name"] in ("relu1", "pool2"):
            name = "norm1" if entry["name"] == "relu1" else "norm2"
            net.append({"type": "lrn", "name": name, "bottom": entry["top"], "top": name,
                        "local_size": 3, "alpha": 5e-05, "beta": 0.75,
                        "norm_region": "within_channel"})
    config["net"] = net
    job = make_job(config)

    def dispatcher(cuda_graph):
        graph, _ = build_train_graph(job)
        assert graph.ops["norm1.fwd"].attrs["norm_region"] == "within_channel"
        prepare_for_device(graph, 0)
        losses = list(loss_blobs(graph))
        watch = add_loss_watch(graph, losses, [1.0] * len(losses), 0)
        rt = SimulatedRuntime(2)
        d = make_dispatcher(graph, runtime=rt, seed=3, cuda_graph=cuda_graph,
                            log=lambda m: None)
        init_params(d.workspace, graph, 5)
        d.workspace[watch][...] = 0.0
        return d, rt, graph, watch

    try:
        eager, _, graph, watch = dispatcher(False)
        try:
            for it in range(5):
                eager.run(it)
            names = [p.name for p in graph.params()] + [watch]
            want = {b: np.array(eager.workspace[b]) for b in names}
        finally:
            eager.close()
        d, rt, graph, watch = dispatcher(True)
        try:
            for it in range(5):
                start = len(rt.calls)
                d.run(it, sync=False)
                calls = [c[0] for c in rt.calls[start:]]
                if it >= 2:
                    assert calls.count("launch_graph") == 1 and "launch" not in calls, calls
            d.drain()
            report = d.capture_report()
            got = {b: np.array(d.workspace[b]) for b in want}
        finally:
            d.close()
    finally:
        gpu.clear_kernel_cache()
    assert report["failed"] == {} and report["eager_gpu_ops"] == {}, report
    assert {"norm1.fwd", "norm2.fwd"} <= set(rt.graphs[0].names())
    for name, value in want.items():
        assert value.tobytes() == got[name].tobytes(), name


@pytest.mark.gpu
def test_case11_lrn_within_channel_on_a_gpu_matches_numpy():
    """Case 11: on a real GPU (CuPy), placed and run by the stream
    dispatcher, values and gradients equal the NumPy path's."""
    from tests.conftest import cuda_cupy_or_skip as _gpu_cupy
    from tests.emulated_gpu import run_graph_on_gpu
    _gpu_cupy()
    inputs = {"x": _rand((2, 3, 7, 6), dtype=np.float32)}
    outs_cpu, grads_cpu = run_op("LRN", WITHIN, inputs, ["x"])
    outs_gpu, grads_gpu = run_graph_on_gpu("LRN", WITHIN, inputs, ["x"])
    for k in (0, 1):
        np.testing.assert_allclose(outs_gpu[k], outs_cpu[k], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads_gpu["x"], grads_cpu["x"], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------- Caffe's cifar10_full

@pytest.fixture(scope="module")
def cifar_tree(tmp_path_factory):
    """A Caffe tree as examples/cifar10/create_cifar10.sh leaves it: the
    train and test LMDBs (3 x 32 x 32 bytes), mean.binaryproto, and Caffe's
    cifar10_full_train_test.prototxt and cifar10_full_solver.prototxt."""
    root = tmp_path_factory.mktemp("cifar_tree")
    c = root / "examples" / "cifar10"
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (24, 3, 32, 32), dtype=np.uint8)
    y = rng.integers(0, 10, 24)
    write_lmdb(c / "cifar10_train_lmdb", x[:16], y[:16])
    write_lmdb(c / "cifar10_test_lmdb", x[16:], y[16:])
    write_mean(c / "mean.binaryproto", x[:16].mean(axis=0))
    for name in ("cifar10_full_train_test.prototxt", "cifar10_full_solver.prototxt"):
        shutil.copy(fixture(name), c / name)
    return root


def test_case11_caffe_cifar10_full_converts_and_trains(cifar_tree):
    """Case 11: Caffe's cifar10_full (two WITHIN_CHANNEL LRNs) converts from
    the tree with its solver, LMDBs and mean file, and trains (Caffe's
    batch of 100; only the iteration counts cut); its ONNX export equals
    our forward pass."""
    res = run_cli_args("convert", "caffe", "examples/cifar10/cifar10_full_train_test.prototxt",
                       "--solver", "examples/cifar10/cifar10_full_solver.prototxt",
                       "--out", "full.yaml", cwd=cifar_tree)
    assert res.returncode == 0, res.stderr
    from purine_mpi.job.config import load_config
    config = load_config(str(cifar_tree / "full.yaml"))
    norms = [e for e in config["net"] if e["type"] == "lrn"]
    assert [(e["name"], e["norm_region"], e["local_size"], e["alpha"], e["k"]) for e in norms] \
        == [("norm1", "within_channel", 3, 5e-05, 1.0), ("norm2", "within_channel", 3, 5e-05, 1.0)]
    train = config["data"]["train"]
    assert (train["source"], train["batch_size"], train["mean_file"]) == (
        "lmdb", 100, str(cifar_tree / "examples/cifar10/mean.binaryproto"))
    assert config["solver"]["base_lr"] == 0.001 and config["solver"]["weight_decay"] == 0.004
    res = run_cli_args("train", "full.yaml", "--out", "run", "--set", "solver.max_iter=2",
                       "--set", "solver.test_iter=1", "--set", "solver.display=1",
                       cwd=cifar_tree, timeout=300)
    assert res.returncode == 0, res.stderr
    losses = [float(v) for v in re.findall(r"^iter \d+/2\s+loss ([0-9.]+)", res.stdout, re.M)]
    assert len(losses) == 2 and all(np.isfinite(losses)), res.stdout
    assert re.search(r"test @ iter 2: loss [0-9.]+\s+accuracy", res.stdout), res.stdout
    from purine_mpi.job.checkpoint_file import load_params
    assert load_params(str(cifar_tree / "run" / "latest.h5"))["conv2/weight"].shape == (
        32, 32, 5, 5)
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from .test_onnx_export import our_forward
    res = run_cli_args("export", "onnx", "full.yaml", "--weights", "run/latest.h5", "--out",
                       "full.onnx", "--batch", 100, "--no-raw-input", cwd=cifar_tree)
    assert res.returncode == 0, res.stderr
    model = onnx.load(str(cifar_tree / "full.onnx"))
    onnx.checker.check_model(model)
    assert "AveragePool" in [n.op_type for n in model.graph.node if n.name.startswith("norm1")]
    ours = our_forward(config, str(cifar_tree / "run" / "latest.h5"))
    logits = ort.InferenceSession(str(cifar_tree / "full.onnx")).run(
        ["ip1"], {"data": ours["data"].astype(np.float32)})[0]
    np.testing.assert_allclose(logits, ours["ip1"], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------- 10: the DOT graph

_DOT_Q = r'"((?:[^"\\]|\\.)*)"'


def _dot_nodes_and_edges(text):
    """Node ids and (from, to, attributes) edges of our DOT output."""
    nodes, edges = set(), []
    for line in text.splitlines()[1:-1]:
        m = re.match(rf'^\s*{_DOT_Q}\s*->\s*{_DOT_Q}\s*(\[(.*)\])?;$', line)
        if m:
            edges.append((m.group(1), m.group(2), m.group(4) or ""))
            continue
        m = re.match(rf'^\s*{_DOT_Q}\s*\[(.*)\];$', line)
        if m:
            nodes.add(m.group(1))
    return nodes, edges


@pytest.mark.parametrize("np_", [1, 2])
def test_case10_dot_graph_has_no_unconnected_blob(digits_h5, np_):
    """Case 10: `graph --np 2 --format dot` drew the grad_bucket blobs with
    no edge; now every blob has an edge, and each bucket has a dashed
    'view' edge to each gradient blob that views it."""
    res = run_cli_here("graph", os.path.join(REPO, "jobs", "digits_lenet.yaml"), "--np", np_,
                       "--format", "dot", "--set", f"data.train.path={digits_h5}",
                       "--set", f"data.test.path={digits_h5}")
    assert res.returncode == 0, res.stderr
    nodes, edges = _dot_nodes_and_edges(res.stdout)
    blobs = {n for n in nodes if n.startswith("b:")}
    ends = {a for a, _, _ in edges} | {b for _, b, _ in edges}
    assert blobs and blobs <= ends, sorted(blobs - ends)
    assert all(a in nodes and b in nodes for a, b, _ in edges)
    buckets = sorted(n for n in blobs if n.startswith("b:grad_bucket"))
    assert bool(buckets) == (np_ == 2)
    for bucket in buckets:
        views = [(b, attrs) for a, b, attrs in edges if a == bucket]
        assert views and all('label="view"' in attrs and "dashed" in attrs for _, attrs in views)
        assert any(b.endswith(".grad") for b, _ in views), views


# --------------------------------------- 7: data cifar10 --from, downloads

def _cifar_env(url, md5):
    env = cli_env()
    env.update(PURINE_CIFAR10_URL=url, PURINE_CIFAR10_MD5=md5)
    return env


def _data_cifar(tmp_path, *args, env=None):
    import subprocess
    from .conftest import PYTHON
    return subprocess.run([PYTHON, "-m", "purine_mpi", "data", "cifar10", *map(str, args)],
                          cwd=tmp_path, env=env or cli_env(), capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("form", ["archive", "folder of the archive", "unpacked folder"])
def test_case7_from_accepts_the_tar_gz_its_folder_or_the_unpacked_folder(tmp_path, form):
    """Case 7: `--from` took only the unpacked folder; a folder holding the
    downloaded .tar.gz failed with "data_batch_1 not found". Now the
    archive, its folder and the unpacked folder give the same file, and the
    temporary unpacked copy is gone afterwards."""
    import h5py
    from .test_download import _archive, _batch
    (tmp_path / "dl").mkdir()
    archive = tmp_path / "dl" / "cifar-10-python.tar.gz"
    _archive(archive)
    if form == "unpacked folder":
        import tarfile
        with tarfile.open(archive) as tar:
            tar.extractall(tmp_path / "dl", filter="data")
        archive.unlink()
    source = archive if form == "archive" else tmp_path / "dl"
    (tmp_path / "out").mkdir()
    res = _data_cifar(tmp_path, "--from", source, "--out", tmp_path / "out" / "c.h5")
    assert res.returncode == 0, res.stderr
    with h5py.File(tmp_path / "out" / "c.h5", "r") as f:
        assert f["train/data"].shape == (30, 3, 32, 32) and f["test/data"].shape == (6, 3, 32, 32)
        np.testing.assert_array_equal(f["test/data"][...],
                                      _batch(6, 5)[b"data"].reshape(-1, 3, 32, 32))
    assert sorted(os.listdir(tmp_path / "out")) == ["c.h5"]
    assert sorted(os.listdir(tmp_path / "dl")) == (
        ["cifar-10-batches-py"] if form == "unpacked folder" else ["cifar-10-python.tar.gz"])


@pytest.mark.parametrize("member", ["../evil", "/tmp/purine-habits-evil", "link"])
def test_case7_an_archive_given_to_from_is_unpacked_safely(tmp_path, member):
    """Case 7: an archive whose member has '..', an absolute path or is a
    link exits 2 naming the member, and writes nothing."""
    import io
    import tarfile
    path = tmp_path / "bad.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(member if member != "link" else "cifar-10-batches-py/data_batch_1")
        if member == "link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
    res = _data_cifar(tmp_path, "--from", path, "--out", tmp_path / "c.h5")
    name = member if member != "link" else "cifar-10-batches-py/data_batch_1"
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert err[-1].startswith(f"error: {path}: member '{name}'") and "refused" in err[-1], err
    assert sorted(os.listdir(tmp_path)) == ["bad.tar.gz"]
    assert not os.path.exists("/tmp/purine-habits-evil") and not (tmp_path.parent / "evil").exists()


def test_case7_a_failed_download_leaves_nothing_behind(tmp_path):
    """Case 7: an unreachable server left an empty cifar-10-download/ beside
    --out; now nothing is left, and the message says --from takes the
    .tar.gz."""
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/cifar-10-python.tar.gz"
    res = _data_cifar(tmp_path, "--download", "--out", tmp_path / "c.h5",
                      env=_cifar_env(url, "0" * 32))
    from .test_cli import assert_user_error
    assert_user_error(res, "could not download", url, "cifar-10-python.tar.gz", "--from")
    assert os.listdir(tmp_path) == []


# ------------------------------------------- 8: predict --calibrate, one host

@pytest.mark.mpi
def test_case8_calibrate_on_one_host_says_it_measured_shared_memory(tmp_path):
    """Case 8: `mpiexec -n 2 predict --calibrate` on one host printed its
    JSON and nothing on what it measured. Now stderr says every rank ran on
    one host, that the figures are MPI's shared memory (with them), and how
    to measure a network; the JSON and the link file say one_host."""
    import json
    from .conftest import run_mpi_cli
    link = tmp_path / "link.json"
    res = run_mpi_cli(2, "predict", "--calibrate", link)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["one_host"] is True and len(out["hosts"]) == 1, out
    notes = [line for line in res.stderr.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1, res.stderr   # rank 0 only
    note = notes[0]
    assert f"all 2 ranks ran on one host ({out['hosts'][0]})" in note, note
    assert "shared memory" in note and "not a network link" in note and "-ppn 1" in note
    assert f"alpha {out['alpha_s'] * 1e6:.3g} us" in note
    assert f"beta {out['beta_bytes_per_s'] / 1e9:.3g} GB/s" in note
    data = json.loads(link.read_text())
    assert data["one_host"] is True and data["hosts"] == out["hosts"]
    assert data["note"] == note[len("note: "):]
