"""Data-parallel composition and graph partitioning: unit checks of the
rewrites (one process) and equivalence runs on several ranks."""
import pytest

from purine_mpi.comm.verify import comm_signature, compare_signatures
from purine_mpi.comm.world import HostTable
from purine_mpi.base.errors import GraphError, UserError
from purine_mpi.graph import Graph, Location
from purine_mpi.parallel.partition import partition_all
from purine_mpi.job.config import dump_config
from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.data_parallel import compose_data_parallel, plan_buckets
from tests.mpi_scripts.common import mlp_config
from tests.mpi_scripts.launch import run_mpi


def _grad_graph(sizes, dtype="float32"):
    g = Graph("g")
    grads = {}
    for i, size in enumerate(sizes):
        g.add_op(f"bwd{i}", "Constant", [], [f"g{i}"],
                 {"value": 1.0, "shape": [size], "dtype": dtype})
        grads[f"p{i}"] = f"g{i}"
    g.infer_shapes()
    return g, grads


# ------------------------------------------------------------ one process
def test_buckets_follow_ready_order_first_bucket_small():
    mb = 2 ** 20 // 4  # float32 elements per MB
    g, grads = _grad_graph([mb // 8, mb // 8, mb // 2, mb // 2, mb, 10])
    plan = plan_buckets(g, grads, bucket_mb=1, first_bucket_mb=0.25, min_buckets=1)
    # p5 (40 bytes) is tiny: it rides with p4 rather than costing a message
    assert [b["params"] for b in plan] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    out = compose_data_parallel(g, grads, 4, 1, bucket_mb=1, first_bucket_mb=0.25,
                                min_buckets=1)
    assert [b["seq"] for b in out] == [0, 1, 2]
    g.infer_shapes().validate()
    b1 = g.blobs["g3"]
    assert (b1.alias_of, b1.offset) == ("grad_bucket1", mb // 2)
    assert g.blobs["g3.sum"].alias_of == "grad_bucket1" and g.blobs["g3.sum"].offset == mb // 2
    assert g.blobs["grad_bucket1"].kind == "bucket" and g.blobs["grad_bucket1"].shape == (mb,)
    ar = g.ops["grad_bucket1.allreduce"]
    assert ar.inputs == ["g2", "g3"] and ar.outputs == ["g2.sum", "g3.sum"]


@pytest.mark.parametrize("sizes,min_buckets", [
    ([1000] * 8, 4), ([100000, 10, 10, 10, 10], 4), ([5000, 300, 20000, 50, 7000, 7000], 5),
    ([1000, 1000, 1000], 4)])
def test_bucket_plan_follows_the_model(sizes, min_buckets):
    """A small model still gets min_buckets buckets (when it has that many
    gradients), in ready order, the first one small, none over bucket_mb."""
    g, grads = _grad_graph(sizes)
    plan = plan_buckets(g, grads, bucket_mb=4, first_bucket_mb=1, min_buckets=min_buckets)
    assert [p for b in plan for p in b["params"]] == list(grads)  # top layer first, all once
    assert len(plan) >= min(min_buckets, len(sizes))
    assert all(b["bytes"] == 4 * sum(sizes[int(p[1:])] for p in b["params"]) for b in plan)
    if len(plan) > 1 and len(plan[0]["params"]) > 1:
        assert plan[0]["bytes"] <= 4 * sum(sizes) / min_buckets / 2 + 4 * min(sizes)
    # without a minimum, these small models fit one bucket: nothing to overlap
    assert len(plan_buckets(g, grads, bucket_mb=4, first_bucket_mb=1, min_buckets=1)) == 1


def test_graph_command_prints_the_bucket_plan(tmp_path, capsys):
    from purine_mpi.cli import main
    cfg = tmp_path / "c.yaml"
    cfg.write_text(dump_config(mlp_config(hidden=(6, 5))))  # a resolved config, minus _path
    assert main(["graph", str(cfg), "--np", "2"]) in (0, None)
    out = capsys.readouterr().out
    lines = out[out.index("bucket plan: "):].splitlines()
    lines = lines[:1] + [x for x in lines[1:] if x.startswith("  seq ")]
    assert len(lines) - 1 >= 4 and lines[0].startswith(f"bucket plan: {len(lines) - 1} ")
    assert lines[1].split()[:2] == ["seq", "0"] and "out/weight" in lines[1]


def test_sgd_updates_read_sum_and_scale():
    g, grads = build_train_graph(mlp_config(), 1, 4)
    compose_data_parallel(g, grads, 4, 1)
    g.infer_shapes().validate()
    updates = [op for op in g.ops.values() if op.op_type == "SGDUpdate"]
    assert updates and all(op.inputs[1].endswith(".grad.sum") for op in updates)
    assert all(op.attrs["grad_scale"] == 0.25 for op in updates)
    reader = g.ops["data"]
    assert (reader.attrs["rank"], reader.attrs["world_size"]) == (1, 4)
    # the first bucket holds the top layer's gradients
    first = min((op for op in g.ops.values() if op.op_type == "Allreduce"),
                key=lambda op: op.attrs["seq"])
    assert first.inputs[0].startswith("out/")


def test_gradients_first_orders_weight_grads_before_lower_layers():
    g, grads = build_train_graph(mlp_config(hidden=(6, 5)))
    compose_data_parallel(g, grads, 2, 0)
    # relu1's backward reads fc2's data gradient: it now waits for fc2's
    # weight and bias gradients, so fc2's bucket can be reduced first
    assert set(g.ops["relu1.bwd.relu_grad"].control_inputs) == {
        "fc2.bwd.inner_product_grad_weight", "fc2.bwd.inner_product_grad_bias"}
    assert set(g.ops["relu2.bwd.relu_grad"].control_inputs) == {
        "out.bwd.inner_product_grad_weight", "out.bwd.inner_product_grad_bias"}
    g.validate()


def test_compare_signatures_names_first_difference():
    g, grads = _grad_graph([10, 20, 30])
    compose_data_parallel(g, grads, 2, 0, bucket_mb=1e-4, first_bucket_mb=1e-5, min_buckets=1)
    h, hgrads = _grad_graph([10, 20, 30])
    compose_data_parallel(h, hgrads, 2, 1, bucket_mb=1, first_bucket_mb=1e-5, min_buckets=1)
    assert compare_signatures([comm_signature(g), comm_signature(g)]) == []
    problems = compare_signatures([comm_signature(g), comm_signature(h)])
    assert problems and problems[0].startswith("collective #1 differs: rank 0 posts "
                                               "Allreduce of 20 float32")


def _pipeline_graph(locs):
    g = Graph("pipe")
    g.add_blob("w", (3,), location=locs[1])
    g.add_op("a", "Constant", [], ["x"], {"value": 2.0, "shape": [3]}, location=locs[0])
    g.add_op("b", "Sum", ["x", "w"], ["y"], location=locs[1])
    g.add_op("c", "Copy", ["y"], ["z"], location=locs[2])
    g.add_op("d", "Sum", ["x", "z"], ["out"], location=locs[2])
    return g.infer_shapes()


def test_partition_pairs_match_and_are_deterministic():
    g = _pipeline_graph([Location(0), Location(1), Location(2)])
    slices = partition_all(g)
    again = partition_all(g.copy())
    sigs = [comm_signature(s) for s in slices]
    assert sigs == [comm_signature(s) for s in again]
    assert compare_signatures(sigs) == []
    sends = {(r, e["peer"], e["tag"]) for r, s in enumerate(sigs) for e in s
             if e["kind"] == "Send"}
    assert sends == {(0, 1, 0), (0, 2, 1), (1, 2, 2)}  # x to 1 and 2, then y
    assert set(slices[2].ops) == {"x.recv", "y.recv", "c", "d"}
    assert slices[2].blobs["x"].kind == "data" and slices[2].blobs["x"].alias_of is None
    for s in slices:
        s.validate()


def test_partition_by_ip_and_device():
    hosts = HostTable([{"hostname": "a", "addresses": ["127.0.0.1", "10.0.0.1"]},
                       {"hostname": "a", "addresses": ["127.0.0.1", "10.0.0.1"]},
                       {"hostname": "b", "addresses": ["127.0.0.1", "10.0.0.2"]}])
    assert hosts.rank_of({"ip": "10.0.0.1", "device": 1}) == 1
    assert hosts.rank_of({"ip": "10.0.0.2", "device": -1}) == 2
    with pytest.raises(UserError, match="several hosts"):
        hosts.rank_of({"ip": "127.0.0.1", "device": 0})
    with pytest.raises(UserError, match="no address of any rank"):
        hosts.rank_of({"ip": "10.9.9.9", "device": 0})
    with pytest.raises(UserError, match="runs only 1 rank"):
        hosts.rank_of({"ip": "10.0.0.2", "device": 1})
    g = _pipeline_graph([Location(0, -1, "10.0.0.1"), Location(0, 1, "10.0.0.1"),
                         Location(0, -1, "10.0.0.2")])
    slices = partition_all(g, hosts=hosts)
    assert set(slices[1].ops) == {"x.recv", "b", "y.send@r2"}
    planned = HostTable.planned([{"ip": "10.0.0.1", "device": 1}, {"ip": "10.0.0.2"}], 3)
    assert planned.rank_of({"ip": "10.0.0.2", "device": -1}) == 2


def test_data_parallel_refuses_a_placed_graph():
    g = _pipeline_graph([Location(0), Location(1), Location(2)])
    with pytest.raises(UserError, match="scheme: pipeline"):
        compose_data_parallel(g, {"w": "y"}, 2, 0)


def test_place_layers_keeps_weights_and_updates_together():
    from purine_mpi.parallel.model_parallel import place_layers
    g, _ = build_train_graph(mlp_config(hidden=(6,)))
    place_layers(g, {"fc1": 1, "relu1": 1, "out": 2, "loss": 2})
    slices = partition_all(g)
    assert set(slices[1].ops) >= {"fc1.fwd", "fc1/weight.update"}
    assert slices[1].blobs["fc1/weight.momentum"].kind == "state"
    assert slices[2].blobs["label"].attrs["received_from"] == 0
    assert "data" in slices[0].ops and "solver.lr" in slices[0].ops


def test_partition_rejects_split_alias():
    g = Graph("bad")
    g.add_blob("w", (2,), location=Location(0))
    g.add_blob("w@new", (2,), location=Location(1), alias_of="w")
    g.add_op("u", "Copy", ["w"], ["w@new"], location=Location(1))
    with pytest.raises(GraphError, match="must be written on the rank that holds"):
        partition_all(g.infer_shapes())


# ------------------------------------------------------------ several ranks
@pytest.mark.mpi
@pytest.mark.parametrize("n,args,delay", [(2, ["0.0002", "check"], ""), (3, [], ""),
                                          (2, ["0.0002", "check"], "3:1"),
                                          (3, ["0.0002", "check"], "3:2"),
                                          (2, ["0.0002", "check", "split"], ""),
                                          (3, ["0.0002", "check", "split"], "3:4"),
                                          (1, ["0.0002", "check", "defer"], "3:8"),
                                          (2, ["0.0002", "check", "defer"], "3:5"),
                                          (3, ["0.0002", "check", "split", "defer"], "3:6")])
def test_data_parallel_equals_one_rank_with_n_times_batch(n, args, delay):
    """Also with seeded random delays in every comm op (PURINE_COMM_DELAY,
    milliseconds:seed) and 3 ranks oversubscribing the cores: the posts move
    around in time, the results and the collective sequence must not. With
    ``split`` the weights are reduced and updated in row chunks; with
    ``defer`` each iteration's tail overlaps the next (bitwise the same)."""
    proc, _ = run_mpi("dp_equiv.py", n, *args, env={"PURINE_COMM_DELAY": delay})
    assert proc.stdout.count("OK dp_equiv") == n


@pytest.mark.mpi
@pytest.mark.parametrize("kind,n", [("data", 2), ("pipeline", 2), ("hybrid", 4)])
def test_clip_gradients_across_ranks_equals_one(kind, n):
    """solver.clip_gradients clips by the norm of the reduced gradients: 2
    data-parallel ranks, 2 pipeline stages (one Allreduce of the squared
    norm), or 2 replicas x 2 stages give the parameters of one process
    (tests/mpi_scripts/clip_equiv.py)."""
    proc, _ = run_mpi("clip_equiv.py", n, kind)
    assert proc.stdout.count("OK clip_equiv") == n


@pytest.mark.mpi
@pytest.mark.parametrize("n,kind,delay", [(2, "serial", ""), (3, "event", ""),
                                          (3, "event", "3:3")])
def test_partitioned_pipeline_equals_unpartitioned(n, kind, delay):
    proc, _ = run_mpi("partition_equiv.py", n, kind, env={"PURINE_COMM_DELAY": delay})
    assert proc.stdout.count("OK partition") == n


@pytest.mark.mpi
@pytest.mark.parametrize("busy_poll,delay", [("0.001", "2:5"), ("0", "3:6"), ("0.0002", "1:7")])
def test_three_ranks_on_two_cores_never_hang(busy_poll, delay):
    """3 ranks oversubscribing the machine's cores, 60 iterations, the order
    of the collectives re-decided (randomly, by rank 0) every iteration,
    seeded random delays in every comm op, the progress thread testing
    during long ops or not: every run completes (a stall would end it with
    an error within 20 s) and equals one rank with the whole batch."""
    proc, _ = run_mpi("no_hang.py", 3, 60, busy_poll, env={"PURINE_COMM_DELAY": delay},
                      timeout=120)
    assert proc.stdout.count("OK no_hang n=3 iters=60 posting orders seen=60") == 3
