"""The memory plan's colouring (runtime/memory_plan.py) against the plain
algorithm it replaced (issue 44): every pair of placed units tested on
bit sets over the whole schedule, kept here as the reference, verbatim from
before the planner learnt to skip ordered pairs (git 1fd8de4^). The fast
colouring tests only the pairs ``_interference`` finds (lifetimes that
overlap, by an interval query; neighbours in the schedule, on windows of
the bit sets), once for all six colourings: the plan -- every blob's
offset and size, the arena, the control edges it adds -- must be the same
bit for bit, with micro-batches (whose copies made the plain one cost M
squared) and without."""
import pytest

from purine_mpi.job.config import resolve_config
from purine_mpi.runtime import memory_plan as mp
from purine_mpi.tools.graph import compose_for

from .conftest import make_job
from .test_memory_plan import _assert_sound, _job


def _reference_colour(units, order, best_fit, link, align):
    """The colouring of git 1fd8de4^: each unit against every unit placed
    before it, on whole-schedule bit sets; with the rule the pipeline's
    stages added since (control edges only where the ops they move wait for
    no point-to-point transfer the writers do not already wait for)."""
    placed, offsets, total, edges = [], {}, 0, []
    for unit in order:
        touch, before, first, _, nbytes, _ = units[unit][:6]
        size = mp._aligned(nbytes, align)
        busy, soft = [], []
        for p in placed:
            off, end, t, b, p_first, p_key, p_writers = p
            late, early = t & ~before, touch & ~b  # ops that break "p before u", "u before p"
            if not late or not early:
                continue  # ordered already
            if link is not None:
                key, writers = units[unit][6], units[unit][7]
                if key is not None and late.bit_length() <= first and \
                        not late & ~link["mask"][key] and not mp._waits(link, late) & ~before:
                    soft.append((off, end, late, writers))
                    continue
                if p_key is not None and early.bit_length() <= p_first and \
                        not early & ~link["mask"][p_key] and not mp._waits(link, early) & ~b:
                    soft.append((off, end, early, p_writers))
                    continue
            busy.append((off, end))
        busy.sort()
        offset, at, gap = None, 0, None
        for off, end in busy:
            if off - at >= size and (gap is None or (best_fit and off - at < gap)):
                offset, gap = at, off - at
                if not best_fit:
                    break
            at = max(at, end)
        if offset is None:
            offset = at
        for off, end, src, dst in soft:
            if off < offset + size and offset < end:
                edges.append((src, dst))
        key_writers = units[unit][6:8] if link is not None else (None, 0)
        placed.append((offset, offset + size, touch, before, first) + tuple(key_writers))
        offsets[unit] = offset
        total = max(total, offset + size)
    return offsets, total, edges


def _reference_plan(monkeypatch, graph, **kw):
    """``plan_memory`` with the reference colouring in place of the fast one.
    The dynamic first fit (``_dynamic_order``), an order the colourings are
    given, is computed from the fast pairs: the reference colours that
    order as the fast colouring does."""
    real_interference, real_dynamic = mp._interference, mp._dynamic_order
    schedule = {}

    def interference(units, n_ops, link=None):
        schedule["n_ops"], schedule["link"] = n_ops, link
        return link

    def dynamic(units, link, align, tie, limit=None):
        pairs = real_interference(units, schedule["n_ops"], schedule["link"])
        return real_dynamic(units, pairs, align, tie, limit)
    with monkeypatch.context() as m:
        m.setattr(mp, "_interference", interference)
        m.setattr(mp, "_dynamic_order", dynamic)

        def colour(units, order, link, best_fit=False, align=mp.HOST_ALIGN, stop=None):
            # ``stop`` left out: the whole colouring, which loses as the
            # one given up would
            offsets, total, edges = _reference_colour(units, order, best_fit, link, align)
            return offsets, total, [(src, 0, list(mp._bits(dst))) for src, dst in edges]
        m.setattr(mp, "_colour", colour)
        return mp.plan_memory(graph, **kw)


def _same(a, b):
    assert a.total_bytes == b.total_bytes
    assert a.offsets == b.offsets and a.sizes == b.sizes and a.lifetimes == b.lifetimes
    assert a.in_place == b.in_place and a.persistent == b.persistent
    assert a.edges == b.edges  # the same control edges, in the same order


def _graphs(name, np_, rank, sets):
    cfg = resolve_config(_job(name, **sets), check_files=False)
    for phase in ("train", "test"):
        yield phase, lambda: compose_for(make_job(cfg), np_, rank, phase)


@pytest.mark.parametrize("name,np_,sets", [
    ("digits_lenet.yaml", 1, {"parallel.micro_batches": 4}),
    ("gpt_tiny.yaml", 1, {"parallel.micro_batches": 4}),
    ("digits_pipeline.yaml", 2, {"parallel.micro_batches": 4}),
    ("digits_pipeline.yaml", 2, {"parallel.micro_batches": 4, "parallel.schedule": "gpipe"}),
    ("digits_hybrid.yaml", 4, {}),
])
@pytest.mark.parametrize("order_ops", [True, False])
def test_plan_is_the_reference_plan(name, np_, sets, order_ops, monkeypatch, digits_h5,
                                    text_h5):
    data = text_h5 if name.startswith("gpt") else digits_h5
    sets = dict(sets, **{"data.train.path": data, "data.test.path": data})
    checked = 0
    for rank in range(np_):
        for phase, build in _graphs(name, np_, rank, sets):
            graph = build()
            if graph is None:
                continue
            keep = mp.batch_blobs(graph)
            ref_graph = build()
            fast = mp.plan_memory(graph, keep=keep, order_ops=order_ops)
            ref = _reference_plan(monkeypatch, ref_graph, keep=keep, order_ops=order_ops)
            _same(fast, ref)
            assert {n: op.control_inputs for n, op in graph.ops.items()} == \
                {n: op.control_inputs for n, op in ref_graph.ops.items()}
            _assert_sound(graph, fast)
            checked += bool(fast.offsets)
    assert checked


def test_interference_pairs_are_neighbours_only(text_h5, monkeypatch):
    """The pairs ``_interference`` keeps grow with the micro-batch copies,
    not their square: each copy meets its own units and its neighbours'."""
    counts = {}
    for m in (2, 4, 8):
        cfg = resolve_config(_job("gpt_tiny.yaml", **{
            "parallel.micro_batches": m, "data.train.path": text_h5,
            "data.test.path": text_h5}), check_files=False)
        graph = compose_for(make_job(cfg), 1, 0, "train")
        seen = {}
        real = mp._interference

        def spy(units, n_ops, link=None):
            seen["pairs"] = real(units, n_ops, link)
            seen["units"] = len(units)
            return seen["pairs"]
        with monkeypatch.context() as patch:
            patch.setattr(mp, "_interference", spy)
            mp.plan_memory(graph, keep=mp.batch_blobs(graph), order_ops=True)
        counts[m] = (seen["units"], int(seen["pairs"].ptr[-1]))
    (u2, p2), (u4, p4), (u8, p8) = counts[2], counts[4], counts[8]
    # one more copy adds about as many pairs as the one before did
    assert p8 - p4 <= 2.2 * (p4 - p2), counts
    assert p8 / u8 <= 1.2 * p4 / u4, counts


@pytest.mark.parametrize("seed", range(3))
def test_fit_in_python_is_the_numpy_fit(seed, monkeypatch):
    """``_fit`` on a few blocks walks them in Python (``_fit_small``, the
    colourings' common case); on more, NumPy: the same offset either way,
    first and best fit, on random blocks with shared offsets and ends, gaps
    that hold the unit exactly, overlapping blocks and none that fits."""
    import numpy as np
    rng = np.random.default_rng(seed)
    for _ in range(400):
        n = int(rng.integers(1, 40))
        off = rng.integers(0, 12, n) * 64
        end = off + rng.integers(1, 6, n) * 64
        size = int(rng.integers(1, 5)) * 64
        for best_fit in (False, True):
            small = mp._fit(off, end, size, best_fit)
            with monkeypatch.context() as m:
                m.setattr(mp, "FIT_IN_PYTHON", 0)
                assert mp._fit(off, end, size, best_fit) == small, (off, end, size, best_fit)
            assert isinstance(small, int)
