"""ZeRO stage 3 with tensor parallelism (``parallel.scheme: sharded``,
``parallel.shard: 3``, ``parallel.tensor_parallel: t``;
parallel/schemes/sharded.py): R replicas x t shards as scheme tensor lays
them out, the net split as scheme tensor splits it, and each tensor shard's
weights, gradients and optimizer state sharded over its R replicas (the
ranks holding that slice); each bucket's weights gathered within them
before its forward and backward readers. Every collective -- the data
groups' gathers and reduce-scatters, the tensor groups' allreduces -- is
numbered in one order the same on every rank. On 2 replicas x 2-way (4
ranks) and 1 x 2-way (2 ranks) the tiny GPT trains as scheme tensor does
bit for bit (weights, optimizer state, losses, test losses through the
gathered test weights; SGD clipped too); each rank holds tensor's model
state / R; its checkpoints are tensor's files and resume under scheme data
on 1 rank."""
import re

import pytest

from purine_mpi.comm.verify import comm_signature, compare_signatures
from purine_mpi.graph.core import reachable
from purine_mpi.parallel.sharding import PARAM_GATHERED_KIND, WORKING_SET_ATTR
from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.runtime.memory_plan import plan_memory
from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job
from tests.test_micro_batches import _params
from tests.test_sharded import _losses, _model_state, _same, _train
from tests.test_sharded_stages import _bytes
from tests.test_sharded_tensor import _gpt, _tensor_ref, assert_clip_scales, \
    tokens  # noqa: F401  (the fixture)

COLLECTIVES = ("ReduceScatter", "Allgather", "Allreduce")


def _clip(solver, n):
    """SGD (momentum) on 4 ranks clipped to a global norm of 0.05
    (test_sharded_tensor's test_clipping_as_tensor: on this net and layout
    the clip acts)."""
    return 0.05 if (solver, n) == ("sgd", 4) else None


def _cfg(tokens, solver, n):
    """Stage 3's 10 steps, a test pass and a checkpoint at 5 and 10, as
    scheme tensor's reference (_tensor_ref) has them."""
    cfg = _gpt(tokens, "sharded", solver, clip=_clip(solver, n), shard=3,
               check_collectives=True)
    cfg["solver"]["test_interval"] = 5
    cfg["checkpoint"]["interval"] = 5
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokens, train_once):  # noqa: F811
    """{(n, solver): ((tensor's run folder, output), (stage 3's, output))},
    each pair trained once for the tests that read it (tensor's once a
    session: test_sharded_tensor's _tensor_ref)."""
    done = {}

    def get(n, solver):
        if (n, solver) not in done:
            where = tmp_path_factory.mktemp(f"z3tp_{n}_{solver}")
            done[n, solver] = (_tensor_ref(train_once, tokens, n, solver, _clip(solver, n)),
                               _train(where, "sharded", n, _cfg(tokens, solver, n)))
        return done[n, solver]
    return get


def _tests(text):
    return re.findall(r"val @ iter \d+: loss (\S+)", text)


@pytest.mark.mpi
@pytest.mark.parametrize("n,solver", [(4, "adamw"), (4, "sgd"), (2, "adamw"), (2, "sgd")])
def test_stage3_tensor_trains_as_tensor(runs, tokens, n, solver):  # noqa: F811
    """10 steps: the weights and optimizer state at 5 and 10 (whole blobs,
    the files) and the train and test losses equal scheme tensor's bit for
    bit; the start-up block says what each rank holds, its bytes those of
    rank 0's composed graph; on 2 ranks (one replica) it runs as scheme
    tensor and its block says so."""
    (ref, ref_text), (out, text) = runs(n, solver)
    replicas = n // 2
    for name in ("ckpt_5.h5", "latest.h5"):
        _same(_params(ref / name), _params(out / name))
    assert _losses(out) == _losses(ref) and sorted(_losses(out)) == list(range(1, 11))
    assert len(_tests(text)) == 3 and _tests(text) == _tests(ref_text)  # at 0, 5 and 10
    assert "b0_attn (heads, 4 -> 2 per rank" in text
    if replicas == 1:  # one replica: runs as scheme tensor (test_settings_effect)
        assert "sharded with 1 replica: runs as scheme tensor: 1 replica x 2-way" in text
        assert "ZeRO" not in text and "reduce-scattered" not in text
        return
    assert "sharded (ZeRO stage 3): 2 replicas x 2-way tensor parallel" in text
    assert "(the only weights it holds)" in text
    assert _model_state(text) == tuple(_bytes(_cfg(tokens, solver, n), n, 0)[k]
                                       for k in ("weights", "gradients", "optimizer_state"))


@pytest.mark.mpi
def test_stage3_tensor_checkpoint_resumes_on_one_rank(tmp_path, runs, tokens):  # noqa: F811
    """The 2 x 2-way stage-3 checkpoint of iteration 5 continued on 1 rank
    under scheme data with the same global batch gives the losses of
    tensor's checkpoint continued so, bit for bit (the files are the same:
    test_stage3_tensor_trains_as_tensor)."""
    (ref, _), (out, _) = runs(4, "adamw")
    from tests.gpt_nets import gpt_config
    one = gpt_config(tokens, iters=8, batch=8)
    got = []
    for name, run in (("from_sharded", out), ("from_tensor", ref)):
        res, text = _train(tmp_path, name, 1, one, "--resume", run / "ckpt_5.h5")
        assert "resumed from" in text
        got.append(_losses(res))
    assert sorted(got[0]) == [6, 7, 8] and got[0] == got[1]


@pytest.mark.parametrize("n", [4])
@pytest.mark.parametrize("solver", ["adamw", "sgd"])
def test_stage3_tensor_holds_tensors_over_r(tokens, n, solver):  # noqa: F811
    """(One replica, 2 ranks, runs as scheme tensor:
    test_settings_effect.test_sharded_with_one_replica_composes_as_the_plain_scheme.)
    From each rank's composed graph (offline): weights, gradients and
    optimizer state held are scheme tensor's / R within one element per
    bucket (R = n / 2); the full weight buffers (gathered) are the working
    set, transient in the memory plan; the gathers and reduce-scatters go
    to the rank's tensor shard's replicas, the activations' allreduces to
    its tensor group."""
    replicas = n // 2
    state_per_element = 8 if solver == "adamw" else 4
    for rank in range(n):
        plain = _bytes(_gpt(tokens, "tensor", solver), n, rank)
        g = compose_for(make_job(_gpt(tokens, "sharded", solver, shard=3)), n, rank)
        held = model_state_bytes(g)
        buckets = sum(op.op_type == "ReduceScatter" for op in g.ops.values())
        assert buckets > 1
        for key, per_element in (("weights", 4), ("gradients", 4),
                                 ("optimizer_state", state_per_element)):
            assert abs(held[key] - plain[key] / replicas) <= \
                per_element * buckets * (replicas - 1), (rank, key, held, plain)
            if replicas > 1:
                assert held[key] < plain[key]
        assert held["working"] > 0 and held["peak"] == held["held"] + held["working"]
        plan = plan_memory(g)
        full = [name for name, b in g.blobs.items()
                if b.alias_of is None and b.attrs.get(WORKING_SET_ATTR) == "weights"]
        assert {g.blobs[b].kind == PARAM_GATHERED_KIND for b in full} == {True, False}
        assert not [b for b in full if b in plan.persistent]
        groups = {(op.op_type, tuple(op.attrs["group"])) for op in g.ops.values()
                  if op.op_type in COLLECTIVES}
        mine = tuple(range(rank % 2, n, 2))
        group = tuple(range(rank - rank % 2, rank - rank % 2 + 2))
        assert groups == {("ReduceScatter", mine), ("Allgather", mine),
                          ("Allreduce", group)}, rank


@pytest.mark.parametrize("transport", ["auto", "one_sided"])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_stage3_tensor_collectives_in_one_order(tokens, clip, transport):  # noqa: F811
    """The collectives are posted in ``seq`` order, each blocking its
    group's ranks until all of them post it. On every rank of 2 x 2-way:
    none waits for one of a later ``seq``, the gathers interleave with the
    tensor allreduces (the forward's gathers are not all first), and the
    collectives in ``seq`` order are the same names on every rank (one
    order, rank-independent); each group's ranks post the same collectives
    (check_collectives' signature); and posting them so, every rank at
    once, never waits forever: at each point some collective is next on
    every rank of its group. With ``one_sided`` (one node) the same of the
    WindowSyncs in the gathers' stead (test_sharded3_tensor_windows)."""
    cfg = make_job(_gpt(tokens, "sharded", "adamw", shard=3, clip=clip, transport=transport))
    gather = "WindowSync" if transport == "one_sided" else "Allgather"
    signatures, orders = [], []
    for rank in range(4):
        g = compose_for(cfg, 4, rank)
        deps = g.dependencies()
        coll = {n: op.attrs["seq"] for n, op in g.ops.items()
                if op.op_type in COLLECTIVES + ("WindowSync",)}
        late = [(a, b) for a in coll for b in reachable(a, deps) & set(coll)
                if coll[b] > coll[a]]
        assert late == [], (rank, late[:3])
        assert len(set(coll.values())) == len(coll)
        order = [(n, tuple(g.ops[n].attrs.get("group") or range(4)))
                 for n in sorted(coll, key=coll.get)]
        kinds = [g.ops[n].op_type for n, _ in order]
        first_rs = kinds.index("ReduceScatter")
        assert "Allreduce" in kinds[:first_rs] and gather in kinds[:first_rs]
        assert "Allgather" not in kinds or gather == "Allgather"
        gathers = [i for i, k in enumerate(kinds[:first_rs]) if k == gather]
        assert any(kinds[i] == "Allreduce" for i in range(gathers[0], gathers[-1])), kinds
        orders.append(order)
        signatures.append(comm_signature(g))
    assert compare_signatures(signatures) == []
    assert all([n for n, _ in o] == [n for n, _ in orders[0]] for o in orders)
    heads = [0] * 4
    while any(h < len(o) for h, o in zip(heads, orders)):
        ready = [orders[r][heads[r]] for r in range(4) if heads[r] < len(orders[r])
                 and all(heads[m] < len(orders[m]) and orders[m][heads[m]] == orders[r][heads[r]]
                         for m in orders[r][heads[r]][1])]
        assert ready, [o[h] if h < len(o) else None for h, o in zip(heads, orders)]
        for m in ready[0][1]:
            heads[m] += 1


def test_stage3_tensor_clip_counts_each_weight_once(tokens):  # noqa: F811
    """Offline, 2 x 2-way SGD clipped: the clip's allreduce of the squared
    norms is over every rank, after every gather and reduce-scatter; on
    tensor shard 1 the whole (replicated) weights' ZeRO shards count 0, the
    split weights' their scale; on tensor shard 0 every one counts."""
    cfg = make_job(_gpt(tokens, "sharded", "sgd", clip=0.05, shard=3))
    for rank in range(4):
        g = compose_for(cfg, 4, rank)
        assert g.ops["clip.sum"].attrs["group"] == [0, 1, 2, 3]
        seq = g.ops["clip.sum"].attrs["seq"]
        assert seq > max(op.attrs["seq"] for op in g.ops.values()
                         if op.op_type in COLLECTIVES and op.name != "clip.sum")
        assert_clip_scales(g, rank)


def test_graph_np_says_what_each_rank_holds_and_gathers(tmp_path, tokens):  # noqa: F811
    """``graph --np 4 --rank 3``: the rank's weights, gradients and
    optimizer state are its ZeRO shard of its tensor shard's, gathered
    over that shard's replicas; each bucket's forward and backward gather
    is listed with its seq and readers."""
    from tests.conftest import run_cli_here, write_config_file
    path = write_config_file(tmp_path, _gpt(tokens, "sharded", shard=3), "s.yaml")
    res = run_cli_here("graph", path, "--np", "4", "--rank", "3")
    assert res.returncode == 0, res.stderr
    assert ("rank 3 = replica 1, tensor shard 1; sharded (ZeRO): rank 3 holds shard 1 of 2 of "
            "every bucket's weights, gradients and optimizer state of its tensor shard, "
            "reduce-scattered and gathered over ranks [1, 3]") in res.stdout
    assert "tensor-parallel split over ranks [2, 3] (rank 3 = replica 1, shard 1)" \
        in res.stdout
    assert re.search(r"gathered by weight_bucket\d+\.allgather \(seq \d+\); read by", res.stdout)
    assert re.search(r"gathered by weight_bucket\d+\.bwd\.allgather \(seq \d+\); read by",
                     res.stdout)


def _digits_mlp(digits_h5, parallel, batch=8, iters=3):
    """digits, fc(16) -> relu -> fc(10) -> softmax loss, SGD with momentum:
    tensor parallelism splits fc1 by columns and fc2 by rows, fc2's bias (a
    whole weight, added on tensor shard 0 alone) a bucket of its own."""
    return {"name": "mlp", "seed": 1,
            "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                               "batch_size": batch}},
            "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1",
                     "num_output": 16},
                    {"type": "relu", "name": "relu1", "bottom": "fc1", "top": "fc1"},
                    {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2",
                     "num_output": 10},
                    {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"],
                     "top": "loss"}],
            "solver": {"base_lr": 0.05, "momentum": 0.9, "max_iter": iters, "display": 1},
            "parallel": parallel}


@pytest.mark.parametrize("transport,per_host", [("auto", None), ("one_sided", None),
                                                ("one_sided", "1")])
def test_stage3_tensor_bias_bucket_gathered_on_every_shard(digits_h5, monkeypatch, transport,
                                                           per_host):
    """Offline, 2 x 2-way: a bucket holding a row-split fc's bias alone
    (read on tensor shard 0 only) is gathered (its WindowSyncs posted) on
    every tensor shard, before that fc, so every rank posts the same
    collectives at the same seq. (Before: tensor shard 1 had no gather of
    it, every later seq one less there, and the first iteration's
    ``adopt_ready_order`` broadcast rank 0's longer order: MPI error on
    ranks 1 and 3; one_sided: its WindowSyncs last, a hang; one rank a
    host, ``per_host``, the RMA gathers: StopIteration composing it.)"""
    if per_host:
        monkeypatch.setenv("PURINE_RANKS_PER_HOST", per_host)
    cfg = make_job(_digits_mlp(digits_h5, {"scheme": "sharded", "shard": 3,
                                           "tensor_parallel": 2, "transport": transport}))
    first = {"auto": "Allgather", "one_sided": "GetShards" if per_host else "WindowSync"}
    orders = []
    for rank in range(4):
        g = compose_for(cfg, 4, rank)
        orders.append(sorted((op.attrs["seq"], op.name) for op in g.ops.values()
                             if op.op_type in COLLECTIVES + ("WindowSync", "GetShards")))
        bucket, waits = g.storage_root("fc2/bias"), reachable("fc2.fwd", g.dependencies())
        assert [op.name for op in g.ops.values() if op.op_type == first[transport]
                and op.attrs["bucket"] == bucket and op.name in waits], rank
    assert all(o == orders[0] for o in orders), orders


@pytest.mark.mpi
def test_stage3_tensor_bias_bucket_trains_as_one_rank(tmp_path, digits_h5):
    """The net of test_stage3_tensor_bias_bucket_gathered_on_every_shard,
    2 x 2-way on 4 ranks (batch 8 a replica), 3 steps: weights and momenta
    within 1e-5 of 1 rank's with batch 16 (scheme data). Before the fix:
    'Other MPI error' in adopt_ready_order's broadcast on ranks 1 and 3."""
    out, text = _train(tmp_path, "z3tp", 4, _digits_mlp(
        digits_h5, {"scheme": "sharded", "shard": 3, "tensor_parallel": 2,
                    "check_collectives": True}))
    ref, _ = _train(tmp_path, "one", 1, _digits_mlp(digits_h5, {"scheme": "data"}, batch=16))
    assert sorted(_losses(out)) == [1, 2, 3]
    _same(_params(ref / "latest.h5"), _params(out / "latest.h5"), rtol=1e-5)


@pytest.mark.parametrize("other", [0, 1])
def test_ready_order_adopted_only_where_every_rank_posts_the_same(other):
    """``adopt_ready_order`` (after the first iteration) applies rank 0's
    observed order only where one allreduce says every rank's collectives
    are the same list (``other``: another rank's digest is this one's + 1):
    else each rank keeps its seq order (before: rank 0's order broadcast
    onto another list, which posts that rank's collectives out of order or
    breaks the broadcast: test_stage3_tensor_bias_bucket_trains_as_one_rank)."""
    from types import SimpleNamespace
    from purine_mpi.parallel.data_parallel import adopt_ready_order
    posted = []

    class Dispatcher:
        graph = SimpleNamespace(ops={n: SimpleNamespace(op_type="Allreduce") for n in "ab"})
        comm_order = staticmethod(lambda: ["a", "b"])
        comm_ready_order = staticmethod(lambda: ["b", "a"])
        set_comm_order = staticmethod(posted.append)

    world = SimpleNamespace(size=2, allreduce=lambda v, op, what: v + [other, 0],
                            comm=SimpleNamespace(Ibcast=lambda index, root: None),
                            wait=lambda request, what: None)
    got = adopt_ready_order(Dispatcher(), world)
    assert (got, posted) == ((None, []) if other else (["b", "a"], [["b", "a"]]))
