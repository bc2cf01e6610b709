"""``parallel.grad_dtype: bf16`` beyond scheme data (issue 45): the
data-parallel reduction of scheme hybrid (each stage's buckets allreduced
over its replicas), of scheme tensor with replicas (each tensor shard's
buckets allreduced over its replicas; the tensor groups' allreduces of
activations and partial sums stay float32), and of scheme sharded with
pipeline stages (ZeRO stages 1-3) and with tensor parallelism (stages 1
and 2) reduce in bfloat16.

Offline, every rank's composed graph: the bucket reductions carry
``wire_dtype: bfloat16`` and move half of float32's bytes (what ``bench
--json`` counts: ``comm.ops.collective_bytes``), everything else (the
tensor groups' allreduces, sharded's weight allgathers) stays float32.
Trained on MPI (one launch per run, shared by the assertions through two
module fixtures; the float32 references trained once a session, with
test_sharded_stages' and test_sharded_tensor's tests): 2 replicas x 2 stages in bf16 end bitwise where scheme
data in bf16 on 2 ranks does (tests/test_grad_dtype.py checks that one
against NumPy; both sum a + b in bfloat16 per element, the stage cut
changes no float op), and sharded x stages at shard 1, 2 and 3 end bitwise
where hybrid does (as in float32: tests/test_sharded_stages.py); 2
replicas x 2-way tensor in bf16 ends bitwise where sharded x tensor at
shard 1, 2 and 3 does (an allreduce against a reduce-scatter, both bfloat16,
of the same 2 ranks); each trains as float32 does (the loss) with other
weights. A pipeline (and scheme none, and tensor on one replica) reduces
no gradient: bf16 is accepted there, and the start-up notes say it has no
effect."""
import numpy as np
import pytest

from purine_mpi.comm.ops import bucket_reductions, collective_bytes, is_collective, moved_bytes
from purine_mpi.parallel.compose import settings_without_effect
from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job
from tests.test_micro_batches import _params
from tests.test_sharded import _job, _losses, _same, _train
from tests.test_sharded_stages import _hybrid_ref, _staged
from tests.test_sharded_tensor import _gpt, _tensor_ref, tokens  # noqa: F401  (the fixture)

BF16 = "bfloat16"


def _configs(tokens):
    """name -> (config in bf16, ranks): each combination built here."""
    return {"hybrid": (_staged("hybrid", grad_dtype="bf16"), 4),
            **{f"sharded{s}_stages": (_staged("sharded", shard=s, grad_dtype="bf16"), 4)
               for s in (1, 2, 3)},
            "tensor": (_gpt(tokens, "tensor", grad_dtype="bf16"), 4),
            **{f"sharded{s}_tensor": (_gpt(tokens, "sharded", shard=s, grad_dtype="bf16"), 4)
               for s in (1, 2, 3)}}


def _fp32(cfg):
    cfg = dict(cfg, parallel=dict(cfg["parallel"]))
    cfg["parallel"].pop("grad_dtype")
    return cfg


# ------------------------------------------------- the composed graphs
@pytest.mark.parametrize("name", ["hybrid", "sharded1_stages", "sharded2_stages",
                                  "sharded3_stages", "tensor", "sharded1_tensor",
                                  "sharded2_tensor", "sharded3_tensor"])
def test_the_buckets_are_reduced_in_bf16_and_nothing_else(tokens, name):  # noqa: F811
    """Every rank: each bucket reduction (Allreduce or ReduceScatter of a
    bucket) reduces in bfloat16, over this rank's replicas, at half its
    float32 bytes; the float32 graph's are the same ops without the attr;
    every other collective -- the tensor groups' allreduces of activations
    and partial sums, sharded's weight allgathers -- keeps float32 blobs
    and bytes. bench's per-type figures follow (collective_bytes)."""
    cfg, n = _configs(tokens)[name]
    for rank in range(n):
        g16 = compose_for(make_job(cfg), n, rank)
        g32 = compose_for(make_job(_fp32(cfg)), n, rank)
        buckets = {op.name for op in bucket_reductions(g16)}
        assert buckets and buckets == {op.name for op in bucket_reductions(g32)}, rank
        replicas = sorted({tuple(g16.ops[b].attrs["group"]) for b in buckets})
        assert replicas == [tuple(range(rank % 2, n, 2))], (rank, replicas)
        halved = {}
        for b in buckets:
            op16, op32 = g16.ops[b], g32.ops[b]
            assert op16.attrs["wire_dtype"] == BF16 and "wire_dtype" not in op32.attrs, b
            assert 2 * moved_bytes(g16, op16) == moved_bytes(g32, op32) > 0, b
            halved[op16.op_type] = halved.get(op16.op_type, 0) + moved_bytes(g16, op16)
        others = [op for op in g16.ops.values() if is_collective(op) and op.name not in buckets]
        for op in others:
            assert "wire_dtype" not in op.attrs, op.name
            assert all(g16.blobs[x].dtype == "float32" for x in op.inputs + op.outputs), op.name
            assert moved_bytes(g16, op) == moved_bytes(g32, g32.ops[op.name]), op.name
        if "tensor" in name:  # the activations' sums: over this rank's tensor group
            group = tuple(range(rank - rank % 2, rank - rank % 2 + 2))
            assert any(op.op_type == "Allreduce" and tuple(op.attrs["group"]) == group
                       for op in others), rank
        if name.startswith("sharded"):
            assert any(op.op_type == "Allgather" for op in others), rank
        bytes16, bytes32 = collective_bytes(g16), collective_bytes(g32)
        assert {k: bytes32[k] - bytes16[k] for k in bytes32} == \
            {k: halved.get(k, 0) for k in bytes32}, rank


def _notes(cfg, n):
    return settings_without_effect(make_job(cfg), n)


def test_without_a_gradient_reduction_bf16_is_noted_as_without_effect(tokens):  # noqa: F811
    """A pipeline reduces no gradient (each stage holds its parameters
    once), nor does scheme none, nor tensor on one replica: bf16 is
    accepted and noted, its graphs have no bucket reduction; with
    replicas no note."""
    why = {"pipeline": "scheme pipeline has no allreduce",
           "none": "scheme none exchanges no gradients",
           "tensor": "parallel.tensor_parallel 2 on 2 ranks is one replica"}
    cfgs = {"pipeline": _staged("pipeline", grad_dtype="bf16"),
            "none": _job("none", grad_dtype="bf16"),
            "tensor": _gpt(tokens, "tensor", grad_dtype="bf16")}
    for scheme, cfg in cfgs.items():
        notes = [x for x in _notes(cfg, 2) if "grad_dtype" in x]
        assert len(notes) == 1 and notes[0].startswith(
            "note: parallel.grad_dtype sets the dtype the gradient buckets are reduced in; "
            + why[scheme]) and notes[0].endswith("so it has no effect: the gradients stay "
                                                 "float32"), (scheme, notes)
        assert not any(bucket_reductions(compose_for(make_job(cfg), 2, r)) for r in (0, 1))
        assert any("parallel.grad_dtype" in x and "no effect" in x
                   for x in _notes(cfg, 1)), scheme
    for name, (cfg, n) in _configs(tokens).items():
        assert not any("grad_dtype" in x for x in _notes(cfg, n)), name


# ---------------------------------------------------------- trained on MPI
def _read(path, text):
    """(checkpoint params, losses by iteration, output) of a train run."""
    return _params(path / "latest.h5"), _losses(path), text


def _runs(tmp, runs):
    """{name: _read's}: each a train run."""
    return {name: _read(*_train(tmp, name, n, cfg)) for name, (n, cfg) in runs.items()}


@pytest.fixture(scope="module")
def staged_runs(tmp_path_factory, train_once):
    """10 steps of AdamW: scheme data in bf16 on 2 ranks; hybrid in fp32
    (test_sharded_stages' _hybrid_ref, trained once a session) and in bf16
    (transport one_sided: its windows carry the activations, the buckets
    are MPI's) and sharded x stages at shard 1-3 in bf16 on 2 replicas x 2
    stages."""
    return {"hybrid32": _read(*_hybrid_ref(train_once, "adamw")),
            **_runs(tmp_path_factory.mktemp("bf16_staged"), {
                "data": (2, _job("data", "adamw", iters=10, grad_dtype="bf16")),
                "hybrid": (4, _staged("hybrid", grad_dtype="bf16", transport="one_sided")),
                **{f"shard{s}": (4, _staged("sharded", shard=s, grad_dtype="bf16"))
                   for s in (1, 2, 3)}})}


@pytest.fixture(scope="module")
def tensor_runs(tmp_path_factory, tokens, train_once):  # noqa: F811
    """10 steps of AdamW on the tiny GPT, 2 replicas x 2-way tensor: scheme
    tensor in fp32 (test_sharded_tensor's _tensor_ref, trained once a
    session) and in bf16, sharded x tensor at shard 1, 2 and 3 in bf16."""
    return {"tensor32": _read(*_tensor_ref(train_once, tokens, 4, "adamw")),
            **_runs(tmp_path_factory.mktemp("bf16_tensor"), {
                "tensor": (4, _gpt(tokens, "tensor", grad_dtype="bf16")),
                **{f"shard{s}": (4, _gpt(tokens, "sharded", shard=s, grad_dtype="bf16"))
                   for s in (1, 2, 3)}})}


def _trains_as_fp32(runs, fp32, bf16):
    """The loss falls, each iteration's within 0.1% of float32's (measured:
    4e-5 hybrid, 1e-5 tensor), the weights elsewhere (the cast is on); the
    start-up block says the dtype."""
    w32, loss32, _ = runs[fp32]
    w16, loss16, text = runs[bf16]
    assert sorted(loss16) == sorted(loss32) == list(range(1, 11))
    assert loss16[10] < loss16[1]
    for it in loss32:
        assert abs(loss16[it] - loss32[it]) <= 1e-3 * loss32[it], (it, loss32[it], loss16[it])
    assert any(not np.array_equal(w32[k], w16[k]) for k in w32 if k.startswith("params/"))
    assert "reduced in bfloat16 (parallel.grad_dtype: bf16): " in text
    assert "half of float32's" in text


@pytest.mark.mpi
def test_hybrid_in_bf16_trains_as_data_in_bf16(staged_runs):
    """Bitwise scheme data's bf16 run (checked against NumPy in
    tests/test_grad_dtype.py): both sum the 2 replicas' gradients a + b in
    bfloat16 per element; and as float32 does, within the rounding."""
    _same(staged_runs["data"][0], staged_runs["hybrid"][0])
    _trains_as_fp32(staged_runs, "hybrid32", "hybrid")


@pytest.mark.mpi
@pytest.mark.parametrize("shard", [1, 2, 3])
def test_sharded_stages_in_bf16_train_as_hybrid_in_bf16(staged_runs, shard):
    """Bitwise hybrid's bf16 run, as in float32 (the 2-rank bfloat16
    reduce-scatter adds a + b as the bfloat16 allreduce does)."""
    w, _, text = staged_runs[f"shard{shard}"]
    assert f"sharded (ZeRO stage {shard}): 2 replicas x 2 stages" in text
    assert "reduced in bfloat16 (parallel.grad_dtype: bf16): " in text
    _same(staged_runs["hybrid"][0], w)


@pytest.mark.mpi
def test_tensor_in_bf16_trains_as_sharded_tensor_in_bf16(tensor_runs):
    """Scheme tensor's bfloat16 allreduce of each tensor shard's buckets
    and sharded's bfloat16 reduce-scatter of them (shard 1, 2 and 3) end
    bitwise equal, as their float32 runs do (tests/test_sharded_tensor.py);
    tensor trains as its float32 run does, within the rounding."""
    for shard in (1, 2, 3):
        w, _, text = tensor_runs[f"shard{shard}"]
        assert f"sharded (ZeRO stage {shard}): 2 replicas x 2-way tensor parallel" in text
        assert "reduced in bfloat16 (parallel.grad_dtype: bf16): " in text
        _same(tensor_runs["tensor"][0], w)
    _trains_as_fp32(tensor_runs, "tensor32", "tensor")
