"""The start-up notes on settings without effect tell the truth ("no
precision or setting is changed behind the user's back").

For every scheme and layout the project runs (those of the scheme tests:
data and sharded on 1 and 2 ranks, scheme none, a pipeline, hybrid,
sharded x stages, tensor and sharded x tensor on 1 and 2 replicas, a
pipeline of 2 stages x 2 tensor shards and 2 replicas of it under hybrid
and sharded) and
every ``parallel`` key some scheme notes as having no effect, every rank's
composed training graph is built offline (``tools.graph.composed``, no
MPI) with the key at its default and set to each other value: where no
value changes the graphs (ops, attrs, blobs, dtypes, the transport lines;
``transport`` also with every rank a host of its own), a start-up note
(``settings_without_effect``) says the key has no effect (or is ignored),
and where a note says so no value changes them. ``defer_update`` shapes no
graph but the dispatcher's deferred tail: its effect is whether any update
is deferred (``Scheme.update_deferred``). Values the config rules refuse in
a layout (exit 2, naming the key) are left out there. Keys read at run time
only (``check_collectives``, ``stall_timeout``, ``backend`` on the CPU) are
not swept.

A group of one rank reduces nothing: hybrid and sharded on one replica (as
many ranks as stages or tensor shards) build no bucket (they run as scheme
pipeline or tensor), so the bucket keys, ``shard`` and ``prefetch`` shape
nothing and ``grad_dtype: bf16`` leaves the gradients float32 -- bitwise
the float32 run's weights after a few steps on 2 ranks (MPI) -- and the
notes and the start-up block say so."""
import contextlib
import os
import re
import types

import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.comm.ops import bucket_reductions
from purine_mpi.graph.seed_yaml import dump
from purine_mpi.parallel.compose import settings_without_effect
from purine_mpi.parallel.schemes import scheme_of
from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.runtime.memory_plan import plan_memory
from purine_mpi.tools.graph import composed, describe_layout
from purine_mpi.train.runlog import gradient_line
from tests.conftest import make_job
from tests.gpt_nets import block_stages, gpt_config, text_h5
from tests.test_micro_batches import _params
from tests.test_sharded import _job, _same, _train
from tests.test_sharded_stages import STAGES, _staged


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return text_h5(tmp_path_factory.mktemp("effect_tokens"))


def _wide(cfg):
    """The residual MLP on 524,288 inputs, one bucket at least
    (``min_buckets: 1``): its first weight's gradient of 16 MiB dominates
    (over split_params' 1 MiB and twice the 4 MB bucket cap: split in row
    chunks), every stage's small gradients share the first bucket (so its
    cap tells), the graph built as shapes only."""
    for phase in cfg["data"].values():
        phase["shape"] = [524288]
    cfg["parallel"]["min_buckets"] = 1
    return cfg


def _gpt(tokens, scheme, **parallel):
    """The tiny GPT of the tensor tests with one block, split 2 ways."""
    return gpt_config(tokens, layers=1, parallel={"scheme": scheme, "tensor_parallel": 2,
                                                  **parallel})


def _gpt1(tokens, scheme):
    """The tiny GPT of the tensor tests with one block, split 2 ways."""
    return gpt_config(tokens, layers=1, parallel={"scheme": scheme, "tensor_parallel": 2})


def _gpt_stages(tokens, scheme="pipeline"):
    """The one-block GPT in 2 stages (the embeddings; the block and the
    head), each split 2 ways (scheme pipeline or hybrid with tensor_parallel)."""
    return gpt_config(tokens, layers=1, parallel={
        "scheme": scheme, "stages": block_stages(1), "tensor_parallel": 2})


#: name -> (config maker (the tokens file), ranks); the keys that make the
#: layout (stages, tensor_parallel) are not swept in it
LAYOUTS = {
    "data on 1 rank": (lambda t: _wide(_job("data")), 1),
    "data on 2 ranks": (lambda t: _wide(_job("data")), 2),
    "none on 2 ranks": (lambda t: _wide(_job("none")), 2),
    "pipeline, 2 stages": (lambda t: _wide(_staged("pipeline")), 2),
    "hybrid, 1 replica x 2 stages": (lambda t: _wide(_staged("hybrid")), 2),
    "hybrid, 2 replicas x 2 stages": (lambda t: _wide(_staged("hybrid")), 4),
    "tensor, 1 replica x 2-way": (lambda t: _gpt1(t, "tensor"), 2),
    "tensor, 2 replicas x 2-way": (lambda t: _gpt1(t, "tensor"), 4),
    "sharded on 1 rank": (lambda t: _wide(_job("sharded")), 1),
    "sharded on 2 ranks": (lambda t: _wide(_job("sharded")), 2),
    "sharded, 1 replica x 2 stages": (lambda t: _wide(_staged("sharded")), 2),
    "sharded, 2 replicas x 2 stages": (lambda t: _wide(_staged("sharded")), 4),
    "sharded, 1 replica x 2-way tensor": (lambda t: _gpt1(t, "sharded"), 2),
    "sharded, 2 replicas x 2-way tensor": (lambda t: _gpt1(t, "sharded"), 4),
    "pipeline, 2 stages x 2-way tensor": (lambda t: _gpt_stages(t), 4),
    "hybrid, 2 replicas x 2 stages x 2-way tensor": (lambda t: _gpt_stages(t, "hybrid"), 8),
    "sharded, 2 replicas x 2 stages x 2-way tensor": (lambda t: _gpt_stages(t, "sharded"), 8),
}

#: (key, the values other than its default): the keys the notes speak of;
#: a key has an effect where one of its values changes what runs.
#: transport: auto takes windows where one_sided would for a pipeline's
#: transfers, and Send/Recv or MPI's collectives where two_sided would for
#: the allreduce; both on one node and with every rank a host (``_HOSTS``)
SETTINGS = [("grad_dtype", ("bf16",)), ("bucket_mb", (0.5,)), ("first_bucket_mb", (0.0001,)),
            ("min_buckets", (8,)), ("split_params", (False,)),
            ("transport", ("one_sided", "two_sided")), ("shard", (2, 3)), ("prefetch", (2,)),
            ("reduce_scatter", (False,)), ("schedule", ("gpipe",)), ("stages", (dict(STAGES),)),
            ("tensor_parallel", (2,)),
            ("ps_ranks", (2,)), ("max_staleness", (1,)), ("defer_update", (False,))]

#: the GPT's weights are all under split_params' 1 MiB: the key is swept on
#: the wide MLP only
NOT_ON_THE_GPT = ("split_params",)
#: the buckets of the GPT and of scheme sharded (which splits no weight in
#: rows) are made smaller: one gradient each (the MLP's, much smaller than
#: 0.5 MiB under the other schemes, would split its wide weight into
#: thousands of row chunks)
SMALL_BUCKETS = {"bucket_mb": 0.0001, "first_bucket_mb": 0.00005}

#: the environments of the transport's sweep: one node, a host per rank
#: whose network does RDMA (auto takes RMA windows across hosts)
_HOSTS = ({}, {"PURINE_RANKS_PER_HOST": "1", "PURINE_RMA_ACROSS_HOSTS": "1"})

#: the keys that make a layout (not swept where it has them)
LAYOUT_KEYS = ("stages", "tensor_parallel")

#: the keys every layout's config is built with at their default (the
#: tests' helpers set small buckets and shard 1)
DEFAULTED = ("bucket_mb", "first_bucket_mb", "shard")


def _base(name, tokens):
    make, n = LAYOUTS[name]
    cfg = make(tokens)
    cfg["parallel"] = {k: v for k, v in cfg["parallel"].items() if k not in DEFAULTED}
    return cfg, n


def _with(cfg, key, value):
    return dict(cfg, parallel=dict(cfg["parallel"], **{key: value}))


def _noted_keys(job, notes):
    """The keys the "no effect" notes name (``note: parallel.a, parallel.b
    ...``); on one rank, where a note says the scheme has no effect, its
    own keys too (``Scheme.keys``)."""
    keys = set()
    for note in notes:
        head = re.match(r"note: ((?:parallel\.\w+(?:, )?)+)", note)
        if head and ("no effect" in note or note.endswith("ignores it")):
            keys.update(k.strip()[len("parallel."):] for k in head.group(1).split(","))
        if note.startswith("note: parallel.scheme ") and "has no effect on 1 rank" in note:
            keys.update(scheme_of(job).keys)
    return keys


@contextlib.contextmanager
def _environment(variables):
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _signature(job, n, rank):
    """What rank ``rank`` of ``n`` runs: every blob and op of its composed
    training graph as the seed YAML writes them, and how its bytes travel."""
    graph, comp = composed(job, n, rank)
    return dump(graph), getattr(graph, "deferrable", None), comp.transport


def _deferred(job, n):
    scheme = scheme_of(job)
    return scheme.update_deferred(job, scheme.layout(job, types.SimpleNamespace(size=n, rank=0)))


class _Graphs:
    """Each job's signatures, built once (every rank; the sweep's
    ``without`` is the same job for every key of a layout)."""

    def __init__(self):
        self.done = {}

    def of(self, cfg, n, hosts=None):
        key = (repr(cfg), n, repr(hosts))
        if key not in self.done:
            job = make_job(cfg)
            with _environment(hosts or {}):
                self.done[key] = [_signature(job, n, r) for r in range(n)]
        return self.done[key]


@pytest.fixture(scope="module")
def graphs():
    return _Graphs()


def _sweep(name, tokens, graphs):
    """[(key, changes anything, [whether each value's notes say it has no
    effect])] of layout ``name``; the values refused there are left out."""
    cfg, n = _base(name, tokens)
    out = []
    for key, values in SETTINGS:
        if key in LAYOUT_KEYS and key in cfg["parallel"] or \
                (key in NOT_ON_THE_GPT and "tensor" in name):
            continue  # the layout's own key, or one the GPT cannot show
        effect, noted = False, []
        for value in values:
            if "tensor" in name or name.startswith("sharded"):
                value = SMALL_BUCKETS.get(key, value)
            changed = _with(cfg, key, value)
            try:
                job = make_job(changed)
                notes = settings_without_effect(job, n)
                if key == "defer_update":
                    effect |= _deferred(job, n) != _deferred(make_job(cfg), n)
                else:
                    effect |= any(graphs.of(changed, n, hosts) != graphs.of(cfg, n, hosts)
                                  for hosts in (_HOSTS if key == "transport" else _HOSTS[:1]))
            except UserError:  # refused in this layout (exit 2, naming the key)
                continue
            noted.append(key in _noted_keys(job, notes))
        if noted:
            out.append((key, effect, noted))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_setting_is_noted_as_without_effect_where_it_changes_nothing(tokens, graphs, name):
    """Noted "no effect" exactly where every rank's graph (or, for
    defer_update, the deferred tail) is the same with the key set."""
    swept = _sweep(name, tokens, graphs)
    assert len(swept) >= 8, swept
    wrong = [(key, "changes what runs but is noted as without effect" if effect else
              "changes nothing but is not noted") for key, effect, noted in swept
             if effect in noted]
    assert not wrong, wrong


def test_grad_dtype_over_a_group_of_one_rank_rounds_nothing():
    """Hybrid and sharded x stages with one replica build no bucket
    reduction (they run as a pipeline), and the notes say grad_dtype has
    no effect; with 2 replicas they reduce in bfloat16."""
    for scheme in ("hybrid", "sharded"):
        cfg = _staged(scheme, grad_dtype="bf16")
        for rank in (0, 1):
            graph, _ = composed(make_job(cfg), 2, rank)
            ops = bucket_reductions(graph)
            assert not ops, (scheme, rank)
        notes = [x for x in settings_without_effect(make_job(cfg), 2) if "grad_dtype" in x]
        assert len(notes) == 1 and "one replica" in notes[0] and \
            notes[0].endswith("so it has no effect: the gradients stay float32"), notes
        assert gradient_line(graph, "bf16") is None  # no start-up row of a reduction
        four, _ = composed(make_job(cfg), 4, 0)
        assert all(op.attrs.get("wire_dtype") == "bfloat16" for op in bucket_reductions(four))
        assert not any("grad_dtype" in x for x in settings_without_effect(make_job(cfg), 4))


@pytest.mark.mpi
@pytest.mark.parametrize("scheme", ["hybrid", "sharded"])
def test_one_replica_in_bf16_ends_bitwise_as_fp32(tmp_path, scheme):
    """2 ranks, 2 stages (one replica), 4 steps of AdamW: the bf16 run's
    weights and optimizer state are the float32 run's bit for bit (nothing
    rounded: no wire_dtype in the graph, and the collective of a one-rank
    group posts nothing, comm/ops.py's ``_alone``), its start-up notes say
    grad_dtype has no effect and its block claims no bfloat16 reduction
    (before: no note, and "reduced in bfloat16 ... half of float32's")."""
    runs = {}
    for name, extra in (("fp32", {}), ("bf16", {"grad_dtype": "bf16"})):
        out, text = _train(tmp_path, name, 2, _staged(scheme, iters=4, **extra))
        runs[name] = (_params(out / "latest.h5"), text)
    _same(runs["fp32"][0], runs["bf16"][0])
    text = runs["bf16"][1]
    assert "note: parallel.grad_dtype sets the dtype the gradient buckets are reduced in; " \
        in text and "so it has no effect: the gradients stay float32" in text, text
    assert "reduced in bfloat16" not in text


@pytest.mark.parametrize("name", ["sharded, 1 replica x 2 stages",
                                  "sharded, 1 replica x 2-way tensor"])
def test_sharded_on_one_replica_notes_its_sharding_keys(tokens, graphs, name):
    """Sharded on one replica runs as scheme pipeline or tensor: shard,
    prefetch and the bucket keys change no rank's graph, and the notes say
    so (before: the buckets were reduce-scattered over one rank, so they
    shaped the graph)."""
    swept = {key: (effect, noted) for key, effect, noted in _sweep(name, tokens, graphs)}
    for key in ("shard", "prefetch", "bucket_mb", "first_bucket_mb", "min_buckets",
                "grad_dtype"):
        assert key in swept and swept[key][0] is False and all(swept[key][1]), (key, swept)


@pytest.mark.parametrize("shard", [1, 2, 3])
@pytest.mark.parametrize("layout", ["stages", "tensor"])
def test_sharded_with_one_replica_composes_as_the_plain_scheme(tokens, layout, shard):
    """2 ranks of 2 stages (2 tensor shards) under scheme sharded at every
    ZeRO stage compose every rank's graph as scheme pipeline (tensor) does:
    no reduce-scatter or allgather over a group of one, no gathered buffer,
    the same memory plan (arena, persistent bytes, model state and peak);
    graph --np says it runs as the plain scheme. On 1 rank scheme sharded
    builds the replica as scheme data does."""
    cfg, like = ((_staged("sharded", shard=shard), _staged("pipeline")) if layout == "stages"
                 else (_gpt(tokens, "sharded", shard=shard), _gpt(tokens, "tensor")))
    for n in (1, 2):
        plain = like if n == 2 else dict(cfg, parallel={"scheme": "data"})
        for rank in range(n):
            g, comp = composed(make_job(cfg), n, rank)
            want, _ = composed(make_job(plain), n, rank)
            assert dump(g) == dump(want), (n, rank)
            assert not [op for op in g.ops.values()
                        if op.op_type in ("ReduceScatter", "Allgather")]
            plans = [plan_memory(x) for x in (g, want)]
            assert [(p.total_bytes, p.persistent_bytes) for p in plans[:1]] == \
                [(p.total_bytes, p.persistent_bytes) for p in plans[1:]]
            assert model_state_bytes(g, plans[0]) == model_state_bytes(want, plans[1])
            if n == 2:
                what = "pipeline" if layout == "stages" else "tensor"
                assert describe_layout(comp.layout, rank, comp).startswith(
                    f"sharded with 1 replica: runs as scheme {what}; layout [sharded: 1 "
                    "replica x 2"), rank
