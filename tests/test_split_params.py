"""A large fully connected weight is reduced and updated in row chunks
(parallel/data_parallel.split_large_params): the graph rewrite, the row
slice of the weight-gradient op, the config key and the plan that
``graph --np`` prints. That N ranks with chunks train like one rank with the
whole batch is checked under mpiexec (tests/test_mpi_parallel.py,
dp_equiv.py ... split)."""
import numpy as np
import pytest

from purine_mpi.base.errors import ShapeError
from purine_mpi.job.config import dump_config
from purine_mpi.graph import Op
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.data_parallel import compose_data_parallel
from tests.conftest import make_job
from tests.mpi_scripts.common import mlp_config

WIDE = dict(hidden=(640,), shape=(1, 32, 32), classes=10)  # fc1: 640 x 1024 floats = 2.5 MiB


def _composed(split=True, solver=None, **kw):
    cfg = mlp_config(batch=4, solver=solver, **dict(WIDE, **kw))
    graph, grads = build_train_graph(make_job(cfg), 0, 2)
    plan = compose_data_parallel(graph, grads, 2, 0, bucket_mb=1, first_bucket_mb=0.25,
                                 split_params=split)
    graph.infer_shapes().validate()
    return graph, plan


def test_grad_weight_rows_are_rows_of_the_full_gradient():
    rng = np.random.default_rng(0)
    dy = rng.standard_normal((6, 10)).astype(np.float32)
    x = rng.standard_normal((6, 3, 2)).astype(np.float32)
    full = dy.T @ x.reshape(6, 6)
    cls = get_kernel_class("InnerProductGradWeight")
    for a, b in ((0, 4), (4, 7), (7, 10)):
        attrs = {"rows": [a, b]}
        assert cls.infer(attrs, [((6, 10), "float32"), ((6, 3, 2), "float32")]) == \
            [((b - a, 6), "float32")]
        out = np.empty((b - a, 6), np.float32)
        cls(Op("probe", "InnerProductGradWeight", [], [], attrs)).run([dy, x], [out])
        np.testing.assert_allclose(out, full[a:b], rtol=1e-6, atol=1e-6)
    with pytest.raises(ShapeError, match="rows"):
        cls.infer({"rows": [5, 11]}, [((6, 10), "float32"), ((6, 3, 2), "float32")])


@pytest.mark.parametrize("solver", [None, {"type": "adam"}])
def test_a_large_weight_is_reduced_and_updated_in_row_chunks(solver):
    graph, plan = _composed(solver=solver)
    chunks = [p for b in plan for p in b["params"] if p.startswith("fc1/weight[")]
    # cap: min(1 MiB, 2.5 MiB of gradients / 4 buckets) -> 4 chunks, a bucket each, in order
    assert chunks == ["fc1/weight[0:160]", "fc1/weight[160:320]", "fc1/weight[320:480]",
                      "fc1/weight[480:640]"]
    bounds = [(0, 160), (160, 320), (320, 480), (480, 640)]
    assert all(sum(p.startswith("fc1/weight[") for p in b["params"]) <= 1 for b in plan)
    # checkpoints and every other reader still see whole blobs
    assert "fc1/weight" in [b.name for b in graph.params()]
    assert not any(n.startswith("fc1/weight[") for n in (b.name for b in graph.params()))
    assert "fc1/weight@new" not in graph.blobs
    states = [s for s in graph.blobs if s.startswith("fc1/weight.") and "[" not in s
              and not s.endswith("@new")]
    assert states and all(graph.blobs[s].alias_of is None for s in states)
    rows = []
    for a, b in bounds:
        op = graph.ops[f"fc1.bwd.inner_product_grad_weight[{a}:{b}]"]
        assert op.attrs["rows"] == [a, b]
        rows.append((a, b))
        up = graph.ops[f"fc1/weight.update[{a}:{b}]"]
        for name in [up.inputs[0]] + up.outputs + up.inputs[2:2 + len(states)]:
            blob = graph.blobs[name]
            assert blob.shape == (b - a, 1024) and blob.offset == a * 1024, name
            assert graph.storage_root(name) in ["fc1/weight"] + states, name
        assert up.inputs[1].endswith(".sum")  # the reduced chunk
    assert "fc1.bwd.inner_product_grad_weight" not in graph.ops
    assert "fc1/weight.update" not in graph.ops
    # the chunk ops stand where the whole ones stood (the dispatcher's tie-break)
    names = list(graph.ops)
    first = names.index("fc1.bwd.inner_product_grad_weight[0:160]")
    assert names[first:first + 4] == [f"fc1.bwd.inner_product_grad_weight[{a}:{b}]"
                                      for a, b in rows]
    # each chunk's update waits for every reader of the whole weight (the
    # forward), not for the other chunks' updates
    deps = graph.dependencies()
    readers = {op.name for op in graph.consumers()["fc1/weight"]}
    assert "fc1.fwd" in readers
    assert all(readers <= deps[f"fc1/weight.update[{a}:{b}]"] for a, b in bounds)
    assert "fc1/weight.update[160:320]" not in deps["fc1/weight.update[0:160]"]


def test_small_weights_and_split_params_false_keep_whole_blobs():
    graph, plan = _composed(split=False)
    assert not any("[" in p for b in plan for p in b["params"])
    assert "fc1/weight.update" in graph.ops
    # under 1 MiB a weight stays whole whatever the bucket size
    graph, plan = _composed(hidden=(200,))  # 200 x 1024 floats = 0.8 MiB
    assert not any("[" in p for b in plan for p in b["params"])


def test_graph_command_prints_the_chunks(tmp_path, capsys):
    from purine_mpi.cli import main
    cfg = mlp_config(batch=4, parallel={"bucket_mb": 1}, **WIDE)
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert main(["graph", str(path), "--np", "2"]) in (0, None)
    out = capsys.readouterr().out
    plan = out[out.index("bucket plan: "):]
    assert "fc1/weight[0:160]" in plan and "fc1/weight[480:640]" in plan
    path.write_text(dump_config(mlp_config(batch=4, parallel={"bucket_mb": 1,
                                                              "split_params": False}, **WIDE)))
    assert main(["graph", str(path), "--np", "2"]) in (0, None)
    assert "fc1/weight[" not in capsys.readouterr().out


def _wide_plan(m, **sets):
    """benchmarks/cifar10_quick_wide.yaml on 2 ranks (rank 0's plan and
    graph): its ip1 weight, 1024 x 1024 floats, is split into 4 row chunks
    at one micro-batch."""
    import os

    from purine_mpi.job.config import load_job
    from purine_mpi.tools.plan import _offline_graphs, offline_footprint
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = load_job(os.path.join(root, "benchmarks", "cifar10_quick_wide.yaml"),
                   [f"parallel.micro_batches={m}", "data.train.num_samples=200"] +
                   [f"{k}={v}" for k, v in sets.items()], None, check_files=False)
    return offline_footprint(job, 2, 0), _offline_graphs(job, 2, 0).graph


#: ip1's row chunks at one micro-batch (by the bucket cap) and with
#: micro-batches: the latter end where hostgemm's row pieces of the whole
#: product (144 rows) end (steps._row_bounds), so each chunk's product is
#: the whole's calls for its rows and the results are the whole's bits
ONE_BOUNDS = [(0, 256), (256, 512), (512, 768), (768, 1024)]
MICRO_BOUNDS = [(0, 288), (288, 576), (576, 720), (720, 1024)]


def _as_micro(buckets):
    """The buckets of one micro-batch with ip1's chunks at MICRO_BOUNDS."""
    names = {f"ip1/weight.grad[{a}:{b}]": f"ip1/weight.grad[{c}:{d}]"
             for (a, b), (c, d) in zip(ONE_BOUNDS, MICRO_BOUNDS)}
    return [[names.get(g, g) for g in bucket] for bucket in buckets]


def test_micro_batches_keep_the_row_chunks():
    """With micro-batches each copy's weight-gradient op writes ip1's row
    chunks, each chunk is summed over the copies, allreduced in the buckets of one
    micro-batch (its chunks' ends moved to the whole product's row pieces')
    and updated alone: the update's temporaries are a chunk's (the largest,
    304 rows), not the whole gradient's. Before: the split was lost under
    micro-batches (ip1's gradient is written by its last running sum, not
    by the gradient op the split looks for) and the first assertion failed
    (4194304 == 1245184); split_params: false keeps it whole."""
    one, graph = _wide_plan(1)

    def allreduced(graph):
        return [op.inputs for op in graph.ops.values() if op.op_type == "Allreduce"]
    buckets = allreduced(graph)
    assert ["ip1/weight.grad[0:256]"] in buckets
    assert one.host["kernel_temporaries"] == 2 ** 20
    for m in (2, 4):
        fp, graph = _wide_plan(m)
        assert fp.host["kernel_temporaries"] == 304 * 1024 * 4, (m, fp.host)
        for k in range(m):
            assert all(f"ip1.bwd.inner_product_grad_weight[{a}:{b}]@mb{k}" in graph.ops
                       for a, b in MICRO_BOUNDS)
        # the buckets of one micro-batch: a chunk's allreduce starts with its rows
        assert allreduced(graph) == _as_micro(buckets), (m, allreduced(graph))
        for a, b in MICRO_BOUNDS:
            assert f"ip1/weight.update[{a}:{b}]" in graph.ops
        whole, graph = _wide_plan(m, **{"parallel.split_params": "false"})
        assert "ip1/weight.update" in graph.ops
        assert whole.host["kernel_temporaries"] == 4 * 2 ** 20


def test_hybrid_micro_batches_keep_each_stages_row_chunks():
    """Scheme hybrid (2 replicas x 2 stages): stage 1's ip1 keeps its row
    chunks under micro-batches too, at its stage's cap (the buckets of one
    micro-batch, the chunks' ends at the whole product's row pieces'), and
    its update's temporaries are a chunk's. Before: 4 MiB (the first
    assertion failed: 4194304 == 1245184)."""
    import os

    from purine_mpi.job.config import load_job
    from purine_mpi.tools.plan import _offline_graphs, offline_footprint
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def plan(m):
        job = load_job(os.path.join(root, "benchmarks", "cifar10_quick_wide.yaml"),
                       ["parallel.scheme=hybrid", "parallel.stages=2",
                        f"parallel.micro_batches={m}", "data.train.num_samples=200"], None,
                       check_files=False)
        graph = _offline_graphs(job, 4, 1).graph
        return offline_footprint(job, 4, 1), [op.inputs for op in graph.ops.values()
                                              if op.op_type == "Allreduce"]
    one, buckets = plan(1)
    assert ["ip1/weight.grad[0:256]"] in buckets
    assert one.host["kernel_temporaries"] == 2 ** 20
    for m in (2, 4):
        fp, got = plan(m)
        assert fp.host["kernel_temporaries"] == 304 * 1024 * 4, (m, fp.host)
        assert got == _as_micro(buckets), (m, got)


def test_row_chunks_end_where_the_host_product_is_cut():
    """steps._row_bounds: where hostgemm cuts the whole product along its
    rows (pieces of 144 rows of 1024; of 96 and 32 of 128) the chunks end
    where its pieces do (the kernel then makes the whole's calls); where it
    does not cut it, the chunks stay; where it cuts it along the inner size
    or the columns, or one chunk would be left, the weight stays whole."""
    from purine_mpi.graph import Graph
    from purine_mpi.parallel.schemes.steps import _row_bounds
    g = Graph()
    g.add_blob("x", (64, 1024), "float32")
    g.add_blob("x4", (4, 1024), "float32")
    g.add_blob("x2k", (2048, 1024), "float32")
    op = Op("gw", "InnerProductGradWeight", ["dy", "x"], ["dw"], {"axis": 1})
    assert _row_bounds(g, op, [0, 256, 512, 768, 1024]) == [0, 288, 576, 720, 1024]
    assert _row_bounds(g, op, [0, 64, 128]) == [0, 96, 128]
    assert _row_bounds(g, op, [0, 100, 200]) == [0, 96, 200]   # pieces of 96, 96 and 8
    assert _row_bounds(g, op, [0, 10, 200]) is None   # one chunk left
    op4 = Op("gw", "InnerProductGradWeight", ["dy", "x4"], ["dw"], {"axis": 1})
    assert _row_bounds(g, op4, [0, 160, 320, 480, 640]) == [0, 160, 320, 480, 640]   # not cut
    op2k = Op("gw", "InnerProductGradWeight", ["dy", "x2k"], ["dw"], {"axis": 1})
    assert _row_bounds(g, op2k, [0, 32, 64]) is None   # 64 rows, K 2048: cut along K
    g.add_blob("xw", (256, 65536), "float32")
    opw = Op("gw", "InnerProductGradWeight", ["dy", "xw"], ["dw"], {"axis": 1})
    assert _row_bounds(g, opw, [0, 32, 64]) is None   # K 256 < N: cut along the columns


def _split_trains_as_whole(tmp_path, n, config_text, *args):
    """``train`` on ``n`` ranks of the config ``config_text(split)`` (YAML)
    with parallel.split_params true, then false (ARGS added): both exit 0
    and their final parameters are equal bit for bit (a difference names
    the blob and how many of its elements differ)."""
    from tests.conftest import run_mpi_cli
    from tests.test_micro_batches import _params
    runs = {}
    for split in (True, False):
        path = tmp_path / f"{split}.yaml"
        path.write_text(config_text(split))
        res = run_mpi_cli(n, "train", path, "--out", tmp_path / str(split), *args, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        runs[split] = _params(tmp_path / str(split) / "latest.h5")
    assert runs[True] and sorted(runs[True]) == sorted(runs[False])
    for k in runs[False]:
        assert np.array_equal(runs[True][k], runs[False][k]), \
            (k, int((runs[True][k] != runs[False][k]).sum()))


@pytest.mark.mpi
@pytest.mark.parametrize("n,parallel", [
    (2, {}), (4, {"scheme": "hybrid", "stages": {"fc1": 0, "relu1": 0, "out": 1, "loss": 1}})])
def test_micro_batch_chunks_train_bitwise_as_the_whole_gradient(tmp_path, n, parallel):
    """2 ranks of data parallelism (4 of hybrid: 2 replicas x 2 stages), 2
    micro-batches of 8, 4 SGD steps: fc1 (640 x 1024) split into row
    chunks (ending where the whole product's row pieces do, each making
    the whole's calls for its rows) trains bit for bit as with split_params: false (today's
    micro-batched results, and the old code's with either setting)."""
    _split_trains_as_whole(tmp_path, n, lambda split: dump_config(mlp_config(
        batch=16, parallel=dict({"bucket_mb": 1, "split_params": split, "micro_batches": 2},
                                **parallel), **WIDE)))
    from purine_mpi.tools.graph import compose_for
    cfg = mlp_config(batch=16, parallel=dict({"bucket_mb": 1, "micro_batches": 2}, **parallel),
                     **WIDE)
    graph = compose_for(make_job(cfg), n, 0)
    # the cap's 4 chunks of 160 rows end where the whole product's row
    # pieces do (336 and 304 rows, 8 samples): 2 chunks
    assert all(f"fc1.bwd.inner_product_grad_weight[{a}:{b}]@mb{k}" in graph.ops
               for a, b in ((0, 336), (336, 640)) for k in (0, 1))


def _chunk_products(threads, monkeypatch, **mlp):
    """An MLP's fc1 split by split_before_copies (2 ranks, 2 micro-batches,
    bucket_mb 0.125): (the chunks' row bounds, the chunks whose host
    product is not the whole product's rows bit for bit, with how many
    elements differ) on random dy and x, at ``threads`` threads."""
    from purine_mpi.ops import hostgemm
    from purine_mpi.parallel.schemes.steps import split_before_copies
    monkeypatch.setattr(hostgemm, "THREADS", threads)
    job = make_job(mlp_config(classes=10, parallel={"bucket_mb": 0.125, "micro_batches": 2},
                              **mlp))
    graph, grads = build_train_graph(job, 0, 2)
    whole_op = next(op for op in graph.ops.values() if op.op_type == "InnerProductGradWeight"
                    and op.outputs == [grads["fc1/weight"]])
    shape = graph.blobs[grads["fc1/weight"]].shape
    split_before_copies(graph, grads, job)
    chunks = [op for op in graph.ops.values() if op.op_type == "InnerProductGradWeight"
              and "rows" in op.attrs]
    rng = np.random.default_rng(1)
    x = rng.standard_normal(graph.blobs[whole_op.inputs[1]].shape).astype(np.float32)
    dy = rng.standard_normal(graph.blobs[whole_op.inputs[0]].shape).astype(np.float32)
    cls = get_kernel_class("InnerProductGradWeight")
    whole = np.empty(shape, np.float32)
    cls(whole_op).run([dy, x], [whole])
    differ = []
    for op in chunks:
        a, b = op.attrs["rows"]
        part = np.empty((b - a, whole.shape[1]), np.float32)
        cls(op).run([dy, x], [part])
        if not np.array_equal(part, whole[a:b]):
            differ.append((a, b, int((part != whole[a:b]).sum())))
    return [tuple(op.attrs["rows"]) for op in chunks], differ


@pytest.mark.parametrize("threads", [1, 2])
def test_micro_batch_chunks_products_are_the_whole_products_rows(monkeypatch, threads):
    """What split_before_copies's bit-for-bit claim rests on: each row
    chunk's weight-gradient product (the kernel with attr ``rows``) gives
    the whole product's rows bit for bit, at any thread count. fc1 (1000 x
    300, 512 samples a micro-batch) at bucket_mb 0.125 was cut in 10 chunks
    of 100 rows; hostgemm cuts the whole product in row pieces of 144 and a
    chunk of 100 in pieces of 96 and 4: the 4-row product takes another
    BLAS path than the same rows inside a 96-row one, and their bits
    differ (before: _rows_alike accepted it, as both are cut along rows,
    and 1096 of its 1200 elements differed: the assertion failed on
    chunk [0:100]). Now the chunks end where the whole's pieces do and
    run its calls."""
    bounds, differ = _chunk_products(threads, monkeypatch, batch=1024, hidden=(1000,),
                                     shape=(1, 15, 20))
    assert not differ, differ
    assert bounds == [(0, 144), (144, 288), (288, 432), (432, 576), (576, 720), (720, 864),
                      (864, 1000)]


def test_one_row_chunks_leave_the_weight_whole(monkeypatch):
    """fc1 of 8 outputs and 40000 inputs, 12 samples a micro-batch: its
    product (3.8M multiply-adds) is one BLAS call, and at bucket_mb 0.125
    the split made 8 chunks of 1 row, whose products (OpenBLAS's
    matrix-vector path) differ from the whole call's rows (before: the
    assertion failed, 8 chunks differing). Such a weight now stays whole."""
    bounds, differ = _chunk_products(1, monkeypatch, batch=24, hidden=(8,), shape=(1, 200, 200))
    assert not differ, differ
    assert bounds == []


@pytest.mark.mpi
def test_micro_batch_chunks_of_a_row_cut_product_train_bitwise(tmp_path):
    """2 ranks, 2 micro-batches of 512, 2 SGD steps: fc1 (1000 x 300, whose
    host product hostgemm cuts in row pieces of 144) split at bucket_mb
    0.125 trains bit for bit as with split_params: false. Before: the
    chunks were 100 rows, each product cut 96 + 4 on its own, and the
    weights differed (the assertion failed on params/fc1/bias, 97 of 1000
    elements, after 2 steps)."""
    def config(split):
        cfg = mlp_config(batch=1024, hidden=(1000,), shape=(1, 15, 20), classes=10,
                         parallel={"bucket_mb": 0.125, "split_params": split,
                                   "micro_batches": 2})
        return dump_config(cfg).replace("num_samples: 96", "num_samples: 4096")
    _split_trains_as_whole(tmp_path, 2, config, "--iters", 2)


#: scheme hybrid with tensor shards: 2 replicas x 2 stages x 2 shards, an
#: MLP whose fc1 (640 x 1024) is column-split (320 rows a shard) on stage 0
TENSOR_MLP = dict(hidden=(640, 640, 640), shape=(1, 32, 32), classes=10)
TENSOR_HYBRID = {"scheme": "hybrid", "tensor_parallel": 2, "bucket_mb": 0.25,
                 "micro_batches": 2,
                 "stages": {"fc1": 0, "relu1": 0, "fc2": 0, "relu2": 0,
                            "fc3": 1, "relu3": 1, "out": 1, "loss": 1}}


def test_hybrid_tensor_micro_batches_keep_the_shards_row_chunks():
    """Scheme hybrid with tensor shards: each copy's weight-gradient op
    writes the row chunks of fc1's shard (320 rows, chunks of 64 at the
    stage's cap: each micro-batch's product of 8 samples one BLAS call),
    each chunk summed over the copies, allreduced over the stage's shard
    replicas and updated alone; the weight itself stays one blob (the
    chunks are views: the checkpoint joins the shards as before). Before,
    the split was skipped with tensor shards and fc1's gradient was one
    blob (no 'fc1.bwd.inner_product_grad_weight[0:64]@mb0')."""
    from purine_mpi.tools.graph import compose_for
    for split in (True, False):
        cfg = mlp_config(batch=16, parallel=dict(TENSOR_HYBRID, split_params=split),
                         **TENSOR_MLP)
        graph = compose_for(make_job(cfg), 8, 1)   # stage 0, shard 1
        chunks = [(a, a + 64) for a in range(0, 320, 64)]
        got = all(f"fc1.bwd.inner_product_grad_weight[{a}:{b}]@mb{k}" in graph.ops
                  for a, b in chunks for k in (0, 1))
        assert got == split, split
        assert graph.blobs["fc1/weight"].shape == (320, 1024)
        reduced = [[b for b in op.inputs if b.startswith("fc1/weight.grad")]
                   for op in graph.ops.values() if op.op_type == "Allreduce"]
        reduced = [b for b in reduced if b]   # a chunk a bucket (the last with fc1's bias)
        assert reduced == ([[f"fc1/weight.grad[{a}:{b}]"] for a, b in chunks] if split
                           else [["fc1/weight.grad"]]), reduced


@pytest.mark.mpi
def test_hybrid_tensor_micro_batch_chunks_train_bitwise(tmp_path):
    """8 ranks of scheme hybrid (2 replicas x 2 stages x 2 tensor shards),
    2 micro-batches of 8, 4 SGD steps: fc1's shards split into row chunks
    train bit for bit as with split_params: false."""
    _split_trains_as_whole(tmp_path, 8, lambda split: dump_config(mlp_config(
        batch=16, parallel=dict(TENSOR_HYBRID, split_params=split), **TENSOR_MLP)))
