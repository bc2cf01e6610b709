"""The streamed gathered save of the staged and tensor-split layouts
(parallel/schemes/base.py ``streamed_join``; scheme sharded's with stages
or tensor shards, with its ``_join_plan``): every rank's part sent to rank
0 parameter by parameter gives the datasets ``join_checkpoint`` makes of
all the parts at once, in its order. In process: one thread a rank, a
world whose collectives meet at a barrier (the peak RSS tests: mpiexec)."""
import threading
import types

import numpy as np
import pytest

from purine_mpi.parallel.schemes.base import Layout, streamed_join
from purine_mpi.parallel.schemes.pipeline import Pipeline
from purine_mpi.parallel.schemes.tensor import TensorParallel
from purine_mpi.parallel.tensor_parallel import take_shard


class _ThreadWorld:
    """Rank ``rank`` of ``size`` threads: allgather_object and gatherv
    (the collectives a streamed save runs), each a meeting of every rank;
    ``calls`` records the ops rank 0 waited on."""

    def __init__(self, hub, rank):
        self.hub, self.rank, self.size = hub, rank, hub["size"]
        self.calls = []

    def _meet(self, value):
        hub = self.hub
        hub["box"][self.rank] = value
        hub["barrier"].wait()
        got = list(hub["box"])
        hub["barrier"].wait()
        return got

    def allgather_object(self, obj, what=""):
        return self._meet(obj)

    def gatherv(self, send, recv, counts, root=0, what=""):
        data = np.ascontiguousarray(send).reshape(-1).view(np.uint8).copy()
        assert data.size == counts[self.rank], (what, self.rank)
        got = self._meet(data)
        if self.rank == root:
            self.calls.append(what)
            recv.reshape(-1).view(np.uint8)[:] = np.concatenate(got)


def _split(axis, parts, index, shape):
    return {"axis": axis, "parts": parts, "index": index, "shape": list(shape)}


def _parts(lay, rng):
    """Every rank's (params, solver) and graph: replica 0 and 1 hold the
    same values; stage s holds ``s<s>/w`` (split on axis 0 with tensor
    shards), ``s<s>/b`` (whole) and AdamW's two states of each."""
    wholes = {}
    for s in range(lay.stages):
        wholes[f"s{s}/w"] = rng.standard_normal((4 * lay.tensor, 3)).astype(np.float32)
        wholes[f"s{s}/b"] = rng.standard_normal(5).astype(np.float32)
    states = {(p, x): rng.standard_normal(v.shape).astype(v.dtype)
              for p, v in wholes.items() for x in ("m", "v")}
    out = []
    for rank in range(lay.replicas * lay.stages * lay.tensor):
        replica, rest = divmod(rank, lay.stages * lay.tensor)
        stage, shard = divmod(rest, lay.tensor)
        blobs, params, solver = {}, {}, {}
        for p in (f"s{stage}/w", f"s{stage}/b"):
            split = _split(0, lay.tensor, shard, wholes[p].shape) \
                if lay.tensor > 1 and p.endswith("/w") else None
            piece = (lambda a: take_shard(split, a)) if split else (lambda a: a.copy())
            blobs[p] = types.SimpleNamespace(attrs={"tensor_split": split} if split else {})
            params[p] = piece(wholes[p])
            solver[p] = {x: piece(states[(p, x)]) for x in ("m", "v")}
        out.append((types.SimpleNamespace(graph=types.SimpleNamespace(blobs=blobs),
                                          layout=Layout("x", lay.replicas, lay.stages,
                                                        replica, stage, tensor=lay.tensor,
                                                        shard=shard)),
                    params, solver))
    return out


def _stream(parts):
    return _run_ranks(len(parts), lambda r, world: streamed_join(
        parts[r][0], world, parts[r][1], parts[r][2]))


def _run_ranks(n, sections_of):
    """``sections_of(rank, world)`` on ``n`` threads, one a rank: every
    rank's written (params, solver) pairs and the gathers rank 0 waited on."""
    hub = {"size": n, "box": [None] * n, "barrier": threading.Barrier(n)}
    worlds = [_ThreadWorld(hub, r) for r in range(n)]
    written, errors = {}, []

    def rank(r):
        try:
            sections = sections_of(r, worlds[r])
            # as the writer does: each pair used before the next is drawn
            got = [[(k, {s: np.array(x) for s, x in v.items()} if isinstance(v, dict)
                     else np.array(v)) for k, v in section.items()] for section in sections]
            written[r] = got
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            hub["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return written, worlds[0].calls


def _same_sections(written, joined, n):
    """Rank 0's pairs are ``joined``'s, key for key in its order, dtype and
    bits; the other ranks wrote none."""
    params, solver = written[0]
    assert [k for k, _ in params] == list(joined[0])
    assert [k for k, _ in solver] == list(joined[1])
    for k, v in params:
        assert v.dtype == joined[0][k].dtype and v.shape == joined[0][k].shape, k
        assert v.tobytes() == np.ascontiguousarray(joined[0][k]).tobytes(), k
    for k, v in solver:
        assert list(v) == list(joined[1][k])
        for x in v:
            want = np.ascontiguousarray(joined[1][k][x])
            assert v[x].dtype == want.dtype and v[x].tobytes() == want.tobytes(), (k, x)
    assert all(written[r] == [[], []] for r in range(1, n))


@pytest.mark.parametrize("replicas,stages,tensor,scheme", [
    (1, 2, 1, Pipeline), (2, 2, 1, Pipeline), (1, 2, 2, Pipeline), (2, 2, 2, Pipeline),
    (1, 1, 2, TensorParallel), (2, 1, 2, TensorParallel)])
def test_the_stream_writes_the_join_in_its_order(replicas, stages, tensor, scheme):
    """Pipeline, hybrid (replicas x stages), tensor x pipeline, 3-D and
    scheme tensor: rank 0's pairs are the join's, key for key in its order
    and bit for bit; the other ranks yield none; every weight and state
    rank 0 does not hold alone came by one gather naming it."""
    lay = Layout("x", replicas, stages, 0, 0, tensor=tensor)
    parts = _parts(lay, np.random.default_rng(stages * 10 + tensor))
    graphs0 = parts[0][0]
    if scheme is Pipeline and tensor > 1:  # Pipeline's join reads each rank's splits
        joined = scheme().join_checkpoint(graphs0, [
            (p, s, {k: g.graph.blobs[k].attrs.get("tensor_split") for k in p})
            for g, p, s in parts])
    else:
        graph0 = types.SimpleNamespace(blobs={k: v for g, _, _ in parts[:tensor]
                                              for k, v in g.graph.blobs.items()})
        joined = scheme().join_checkpoint(types.SimpleNamespace(graph=graph0, layout=lay),
                                          [(p, s) for _, p, s in parts])
    written, calls = _stream(parts)
    _same_sections(written, joined, len(parts))
    # stage 0's whole weights are rank 0's own: gathered only with shards
    sent = [f"'{p}'" for p in joined[0] if tensor > 1 and p.endswith("/w") or
            not p.startswith("s0/")]
    assert len(calls) == 3 * len(sent), calls
    for p in sent:
        assert sum(p in c and "weight" in c for c in calls) == 1
        assert sum(p in c and "solver state" in c for c in calls) == 2


@pytest.mark.mpi
def test_the_sharded_stream_on_4_ranks_writes_the_files_of_the_join(tmp_path):
    """Scheme sharded as 2 replicas x 2 stages (ZeRO stages 1 and 3) and 2
    replicas x 2-way tensor (stage 3), AdamW, trained on 4 ranks: each
    checkpoint file holds the datasets ``join_checkpoint`` makes of every
    rank's ``checkpoint_parts`` gathered at once, bit for bit and in its
    order, with their checksums (tests/mpi_scripts/sharded_save_split.py)."""
    from tests.mpi_scripts.launch import run_mpi
    proc, _ = run_mpi("sharded_save_split.py", 4, tmp_path, timeout=600)
    assert proc.stdout.count("OK sharded_save_split n=4 rank") == 4, proc.stdout + proc.stderr


class _RandomBlobs(dict):
    """A rank's workspace: each blob of ``graph`` asked for made at once,
    random values of its shape and dtype from ``rng`` (every rank its own:
    a piece taken from the wrong rank or place shows)."""

    def __init__(self, graph, rng):
        super().__init__()
        self.graph, self.rng = graph, rng

    def __missing__(self, name):
        blob = self.graph.blobs[name]
        self[name] = self.rng.standard_normal(tuple(blob.shape)).astype(blob.dtype)
        return self[name]


@pytest.mark.parametrize("layout,shard", [("stages", 1), ("stages", 2), ("stages", 3),
                                          ("tensor", 1), ("tensor", 2), ("tensor", 3)])
def test_the_sharded_stream_writes_the_join_in_its_order(tmp_path, layout, shard):
    """Scheme sharded with pipeline stages (2 replicas x 2 stages: the
    residual MLP of test_sharded_stages) and with tensor parallelism (2
    replicas x 2-way: the GPT of test_sharded_tensor), AdamW, stages 1-3,
    each of 4 ranks composed as it runs (its ZeRO shard of its stage's or
    tensor shard's buckets; small buckets, so the shards cut parameters
    apart), each rank's blobs random values of its own: the streamed
    sections are ``join_checkpoint``'s of every rank's
    ``checkpoint_parts``, key for key in its order and bit for bit; each
    gather brings one parameter's weight or one of its states, some from
    the two replicas' ZeRO shards (ranks 0 and 2)."""
    import re
    from purine_mpi.parallel.schemes.sharded import Sharded
    from purine_mpi.tools.graph import composed
    from tests.conftest import make_job
    if layout == "stages":
        from tests.test_sharded_stages import _staged
        cfg = _staged("sharded", shard=shard)
    else:
        from tests.gpt_nets import text_h5
        from tests.test_sharded_tensor import _gpt
        cfg = _gpt(text_h5(tmp_path), "sharded", shard=shard)
    job, scheme = make_job(cfg), Sharded()
    ranks = []
    for r in range(4):
        graph, comp = composed(job, 4, r)
        ranks.append((types.SimpleNamespace(graph=graph, layout=comp.layout, composition=comp,
                                            params=[b.name for b in graph.params()]),
                      _RandomBlobs(graph, np.random.default_rng(r))))

    def local(graphs, ws):  # train/checkpoints.py's _held: no per-parameter state
        return lambda: ({p: ws[p] for p in scheme.held_weights(graphs)}, {})

    parts = [scheme.checkpoint_parts(graphs, ws, local(graphs, ws)) for graphs, ws in ranks]
    joined = scheme.join_checkpoint(ranks[0][0], parts)
    written, calls = _run_ranks(4, lambda r, world: scheme.checkpoint_sections(
        *ranks[r], world, local(*ranks[r])))
    _same_sections(written, joined, 4)
    assert len(joined[1]) == len(joined[0]) and \
        all(list(v) == ["m", "v"] for v in joined[1].values())
    said = re.compile(r"the checkpoint's gather of the (weight|solver state '[mv]' of) '([^']+)' "
                      r"from ranks \[([\d, ]+)\] \(Igatherv\)")
    got = [said.fullmatch(c) for c in calls]
    assert all(got), calls
    # a state rank 0 holds whole alone is its own; some are both replicas' pieces
    states = [m.group(3).split(", ") for m in got if m.group(1) != "weight"]
    assert 0 < len(states) <= 2 * len(joined[1])
    assert any({"0", "2"} <= set(held) for held in states), states


@pytest.mark.mpi
@pytest.mark.slow
def test_the_end_checkpoint_of_two_stages_adds_about_a_parameter_to_the_peak_rss(tmp_path):
    """8 fc layers of 768 x 768 cut into 2 stages, AdamW: the end's
    checkpoint streams stage 1's parameters to rank 0 one at a time, so on
    every rank the peak RSS of the whole run (memory.json's
    ``peak_rss_bytes``) exceeds the loop's (``loop_peak_rss_bytes``, before
    that checkpoint) by less than twice the largest parameter's whole
    weight and AdamW state (2 x 3 x 2.25 MiB: the receive buffers and a
    tensor split's join) and 16 MiB. The pickled gather of every rank's
    parts and their join on rank 0 it replaces (stage 1's 27 MiB, pickled,
    received and unpickled there) exceeds that bound. The file is the
    1-rank run's datasets, in its order."""
    import json
    import h5py
    from tests.conftest import run_cli_args, run_mpi_cli, write_config_file
    from tests.test_sharded_rss import _deep_mlp
    cfg = _deep_mlp()
    stage_of = {layer["name"]: int(i >= 8) for i, layer in enumerate(cfg["net"])}
    cfg["parallel"] = {"scheme": "pipeline", "stages": stage_of}
    path = write_config_file(tmp_path, cfg, "deep_mlp.yaml")
    res = run_mpi_cli(2, "train", path, "--out", tmp_path / "run", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    one = write_config_file(tmp_path, dict(cfg, parallel={"scheme": "data"}), "one.yaml")
    res = run_cli_args("train", one, "--out", tmp_path / "one")
    assert res.returncode == 0, res.stdout + res.stderr
    biggest = 3 * 768 * 768 * 4  # fc weight + AdamW's two states, float32
    ranks = json.loads((tmp_path / "run" / "memory.json").read_text())["ranks"]
    for r in ranks:
        assert r["peak_rss_bytes"] - r["loop_peak_rss_bytes"] < 2 * biggest + (16 << 20), r

    with h5py.File(tmp_path / "run" / "latest.h5") as two, \
            h5py.File(tmp_path / "one" / "latest.h5") as ref:
        assert written_order(two) == written_order(ref)
        for k in written_order(ref):
            np.testing.assert_allclose(two[k][()], ref[k][()], rtol=1e-5, atol=1e-7)


@pytest.mark.mpi
@pytest.mark.slow
def test_the_end_checkpoint_of_sharded_stages_adds_about_a_parameter_to_the_peak_rss(tmp_path):
    """The 8 fc layers of 768 x 768 above as scheme sharded at ZeRO stage
    3 on 2 replicas x 2 stages (4 ranks), AdamW: the end's checkpoint
    streams each parameter's pieces -- its weight's and each state's, from
    its stage's two ranks -- to rank 0 as its turn comes, so on every rank
    the peak RSS of the whole run exceeds the loop's by less than the
    bound above (twice the largest parameter's weight and AdamW state, and
    16 MiB). The gather of every rank's pieces to rank 0 at once (the
    whole model's weights and state, 54 MiB, pickled, received, unpickled
    and joined there) it replaces exceeds it: measured +6.1-7.0 MiB (+3.7-5.1
    on 2026-11-29) on rank
    0 (0-0.3 on the others) against +144.4-145.5 MiB before (25-27 on the
    others). The file holds every parameter of the net whole, with both
    AdamW states."""
    import json
    import h5py
    from tests.conftest import run_mpi_cli, write_config_file
    from tests.test_sharded_rss import _deep_mlp
    cfg = _deep_mlp()
    stage_of = {layer["name"]: int(i >= 8) for i, layer in enumerate(cfg["net"])}
    cfg["parallel"] = {"scheme": "sharded", "shard": 3, "stages": stage_of, "bucket_mb": 2.5}
    path = write_config_file(tmp_path, cfg, "deep_mlp.yaml")
    res = run_mpi_cli(4, "train", path, "--out", tmp_path / "run", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    biggest = 3 * 768 * 768 * 4  # fc weight + AdamW's two states, float32
    ranks = json.loads((tmp_path / "run" / "memory.json").read_text())["ranks"]
    assert len(ranks) == 4
    for r in ranks:
        assert r["peak_rss_bytes"] - r["loop_peak_rss_bytes"] < 2 * biggest + (16 << 20), r
    with h5py.File(tmp_path / "run" / "latest.h5") as f:
        names = [k for k in written_order(f) if k.startswith("params/")]
        assert len(names) == 18 and all(
            f[f"solver/{k[len('params/'):]}/{x}"].shape == f[k].shape for k in names
            for x in ("m", "v"))
        assert f["params/fc4/weight"].shape == (768, 768)


def written_order(f):
    """The paths of a checkpoint's /params and /solver datasets in the order
    they were written (its groups track creation order)."""
    import h5py
    out = []

    def walk(group, at):
        for k in group.keys():
            if isinstance(group[k], h5py.Dataset):
                out.append(f"{at}/{k}")
            else:
                walk(group[k], f"{at}/{k}")
    for section in ("params", "solver"):
        walk(f[section], section)
    return out
