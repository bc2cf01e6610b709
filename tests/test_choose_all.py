"""plan --choose's pruning of micro-batch counts (``choose.variants_to_try``)
checked against ``plan --choose-all`` (every count of every setting
evaluated, ``choose(every_count=True)``).

For each net and rank count: one exhaustive choice without a memory limit
gives every setting's bytes per rank and predicted time (neither depends on
the limit's value: the ranks are placed by ``--ranks-per-node``, given);
then, at memory limits between those bytes (so that some counts fit and
some do not, where the pruning leaves counts out), the pruned choice must
name the same best as the exhaustive one re-ranked at that limit, price
every setting it evaluated as the exhaustive one did, and each count it
left out must, where it fits, be predicted no faster than its best. The
nets: one where the activations dominate (tests/test_choose.py's
MICRO_NET: each count holds less), one where the weights do (its NET: every
count past 1 holds more), and one in between (a convolution and a 512-wide
fully connected layer: 2 micro-batches hold more than 1, 4 and more less
than 1), on 1, 2 and 4 ranks; op times from constructed calibration traces
(``_write_calibration``: nothing measured). The comparisons take the data
and sharded settings alone (``_no_staged``): the pipeline, hybrid and
tensor settings have no micro-batch variants (their counts are settings of
their own, every one evaluated by both), cost most of the time to compose
on 2 and 4 ranks, and, where one was the best, would hide a wrong pruning
of the others. Each exhaustive choice is made once (``_every``).

The net in between is the case the pruning lost: it stopped at 2
micro-batches because they held more than 1 (the rule "holds_more"), and
at a limit between 4 micro-batches' bytes and 1's said no setting fits,
where 4 micro-batches do."""
import json

import pytest

from tests.conftest import run_cli_here
from tests.test_choose import MICRO_NET, NET, _write_calibration

#: a 16-channel convolution at batch 32 (its activations) and a 512-wide
#: fully connected layer on its pooled 16x16 output (a 4,096 x 512 weight:
#: 8 MiB, 16 with its gradient): 2 micro-batches hold more than 1 (the running
#: sum of the gradients), 4 and more less than 1 (the activations' quarter)
MIXED_NET = """name: mixed_net
seed: 3
data:
  train: {source: synthetic, shape: [3, 32, 32], classes: 10, num_samples: 256, batch_size: 32}
net:
  - {type: conv, name: c1, bottom: data, top: c1, num_output: 16, kernel: 3, pad: 1}
  - {type: relu, name: r1, bottom: c1, top: c1}
  - {type: pool, name: p1, bottom: c1, top: p1, pool: max, kernel: 2, stride: 2}
  - {type: fc, name: fc1, bottom: p1, top: fc1, num_output: 512}
  - {type: relu, name: r2, bottom: fc1, top: fc1}
  - {type: fc, name: fc, bottom: fc1, top: fc, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc, label], top: loss}
solver: {type: sgd, base_lr: 0.01, momentum: 0.9, max_iter: 100, display: 1}
parallel: {scheme: data}
"""

NETS = {"micro": MICRO_NET, "weights": NET.replace("SCHEME", "data"), "mixed": MIXED_NET,
        # at batch 8 (micro-batch counts 1, 2, 4 and 8): the 4-rank settings
        # compose in a quarter of the time
        "mixed8": MIXED_NET.replace("batch_size: 32", "batch_size: 8"),
        "micro16": MICRO_NET.replace("batch_size: 32", "batch_size: 16")}


def _no_staged(monkeypatch):
    """``choose.candidates`` without the settings that cut the net into
    stages or split it into tensor shards (the module docstring)."""
    import purine_mpi.tools.choose as choose_mod
    real = choose_mod.candidates

    def data_and_sharded(*args, **kwargs):
        return [c for c in real(*args, **kwargs)
                if not any(s.startswith(("parallel.stages=", "parallel.tensor_parallel="))
                           for s in c.sets)]
    monkeypatch.setattr(choose_mod, "candidates", data_and_sharded)


#: (net, ranks, the job's own count) -> the exhaustive Choice without a limit
_EVERY = {}


def _every(jobs, name, n, own=None):
    """``choose(every_count=True)`` of ``jobs[name]`` on ``n`` ranks (at
    ``own`` micro-batches), without a memory limit; made once."""
    from purine_mpi.tools.choose import choose
    if (name, n, own) not in _EVERY:
        path, cal = jobs[name]
        sets = () if own is None else (f"parallel.micro_batches={own}",)
        _EVERY[name, n, own] = choose(path, sets, n, _limits(n), None, cal, every_count=True)
    return _EVERY[name, n, own]


def _limits(n, host=None):
    from purine_mpi.tools.plan import MemoryLimits
    return MemoryLimits(host=host, ranks_per_node=n, node=1 << 45)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{net: (its job file, its calibration file)}."""
    tmp = tmp_path_factory.mktemp("choose_all")
    out = {}
    for name, text in NETS.items():
        path, cal = tmp / f"{name}.yaml", tmp / f"{name}.cal.json"
        path.write_text(text)
        _write_calibration(path, cal)
        out[name] = (str(path), str(cal))
    return out


def _key(c):
    return c.sets


def _per_sample(c):
    return c.iter_s / max(c.samples, 1)


def _fits(c, limit):
    """Whether ``c`` fits a rank's ``limit`` of host memory (its node's,
    ``_limits``, is larger than every need)."""
    return c.error is None and c.need["host"] <= limit


def _best_at(cands, limit):
    """The fastest per sample of ``cands`` that fit ``limit`` (``choose.
    rank``'s first, re-ranked at that limit), or None; never an unranked
    one (the parameter servers: ``choose.PS_NOT_VALIDATED``)."""
    fit = [c for c in cands if _fits(c, limit) and c.unranked is None]
    return min(fit, key=_per_sample) if fit else None


def _limits_between(cands):
    """Limits halfway between the distinct host needs of the micro-batch
    settings (and the plain settings they are counts of)."""
    needs = sorted({c.need["host"] for c in cands if c.error is None and
                    (c.variant_of is not None or "micro-batch" not in c.label)})
    return [(a + b) // 2 for a, b in zip(needs, needs[1:])]


#: the weights net on 2 ranks is not a case (15 s of CI): the mixed net holds
#: its property (2 micro-batches more than 1: the gradients' running sum) and
#: the activations' besides, and it and mixed8 on 2 and 4 ranks took every
#: walk ``variants_to_try`` took for the weights net on 2 ranks, setting by
#: setting (data, parameter server, sharded stages 1-3: a count that fits
#: found or not, the counts above the check left out as "smaller_fits" or none
#: left out; 2026-12-01, each call's outcome recorded over every case here)
@pytest.mark.parametrize("name,n,own,most", [
    ("micro", 1, 1, 5), ("weights", 1, 1, 5), ("mixed", 1, 1, 5), ("mixed", 1, 4, 5),
    ("micro16", 2, 4, 2), ("mixed", 2, 1, 2), ("mixed8", 4, 1, 2)])
def test_pruned_choice_is_the_exhaustive_one(jobs, name, n, own, most, monkeypatch):
    """At limits between the settings' needs (at ``most`` of them, spread
    over their range, for the time on 2 cores), --choose and --choose-all
    agree, from the job's own count ``own`` (``parallel.micro_batches``)."""
    from purine_mpi.tools.choose import choose
    _no_staged(monkeypatch)
    path, cal = jobs[name]
    sets = (f"parallel.micro_batches={own}",)
    every = _every(jobs, name, n, own)
    assert every.not_tried == [] and every.untried == 0
    by_sets = {_key(c): c for c in every.ranked}
    assert len(by_sets) == len(every.ranked)
    limits = _limits_between(every.ranked)
    if len(limits) > most:
        limits = [limits[round(i * (len(limits) - 1) / (most - 1))] for i in range(most)]
    assert limits
    pruned_any = 0
    for limit in limits:
        pruned = choose(path, sets, n, _limits(n, limit), None, cal)
        # the same figures for every setting evaluated
        for c in pruned.ranked:
            e = by_sets[_key(c)]
            assert (c.error, c.need, c.iter_s, c.samples) == \
                (e.error, e.need, e.iter_s, e.samples), c.label
        assert len(pruned.ranked) + len(pruned.not_tried) == len(every.ranked)
        want = _best_at(every.ranked, limit)
        got = pruned.best
        assert (got and got.label) == (want and want.label), (limit, pruned.not_tried)
        for c in pruned.not_tried:
            e = by_sets[_key(c)]
            if want is not None and _fits(e, limit):
                assert _per_sample(e) >= _per_sample(want), (limit, c.label, want.label)
        pruned_any += len(pruned.not_tried)
    assert pruned_any > 0  # the limits do make the pruning leave counts out


def test_mixed_net_four_micro_batches_fit_where_one_and_two_do_not(jobs, monkeypatch):
    """The case the pruning lost (the module docstring): on one rank, at a
    limit between 4 micro-batches' bytes and 1's, the best is 4
    micro-batches (before: no setting fits, 4 not tried as "holds_more")."""
    from purine_mpi.tools.choose import choose
    _no_staged(monkeypatch)
    path, cal = jobs["mixed"]
    every = _every(jobs, "mixed", 1, 1)
    need = {c.label: c.need["host"] for c in every.ranked}
    one, two, four = (need[f"data, recompute none{m}"]
                      for m in ("", ", 2 micro-batches", ", 4 micro-batches"))
    assert four < one < two, need
    limit = (four + one) // 2
    pruned = choose(path, ("parallel.micro_batches=1",), 1, _limits(1, limit), None, cal)
    assert pruned.best is not None, [(c.label, c.not_tried) for c in pruned.not_tried]
    assert pruned.best.label == "data, recompute none, 4 micro-batches"


def test_mixed_net_one_micro_batch_fits_where_two_does_not(jobs, monkeypatch):
    """The same net from 4 micro-batches (the job's own count), at a limit
    between 1 micro-batch's bytes and 2's: 1 fits (and is the fastest),
    2 does not (before: the counts below the job's tried descending while
    they fit, 1 not tried as "larger_does_not_fit": the best was 4)."""
    from purine_mpi.tools.choose import choose
    path, cal = jobs["mixed"]
    _no_staged(monkeypatch)
    sets = ("parallel.micro_batches=4",)
    every = _every(jobs, "mixed", 1, 4)
    need = {c.label: c.need["host"] for c in every.ranked}
    one, two = need["data, recompute none, 1 micro-batch"], \
        need["data, recompute none, 2 micro-batches"]
    assert one < two, need
    pruned = choose(path, sets, 1, _limits(1, (one + two) // 2), None, cal)
    assert pruned.best.label == "data, recompute none, 1 micro-batch", pruned.best.label


def test_choose_all_cli_tries_every_count(jobs):
    """``plan --choose-all --json``: an empty ``not_tried``, every count of
    every setting among the candidates, the best --choose names; the table
    says it tried every count; --help names the option."""
    path, cal = jobs["micro"]
    base = ("plan", path, "--np", 1, "--calibration", cal, "--host-memory", "12MiB")
    res = run_cli_here(*base, "--choose", "--json")
    assert res.returncode == 0, res.stderr
    pruned = json.loads(res.stdout)
    res = run_cli_here(*base, "--choose-all", "--json")
    assert res.returncode == 0, res.stderr
    every = json.loads(res.stdout)
    assert pruned["not_tried"] and every["not_tried"] == []
    assert len(every["candidates"]) == len(pruned["candidates"]) + len(pruned["not_tried"]) \
        == 10  # recompute none and full, each at 1, 2, 4, 8 and 16 micro-batches
    assert every["best"] == pruned["best"] == ["parallel.scheme=data", "recompute=none",
                                               "parallel.micro_batches=4",
                                               "parallel.mode=sync"]
    res = run_cli_here(*base, "--choose-all")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("plan --choose-all: 1 rank, 10 settings tried (every "
                                 "micro-batch count)"), res.stdout
    assert "not tried" not in res.stdout
    res = run_cli_here("plan", "--help")
    assert "--choose-all" in res.stdout
    # --help says the walk's trade-off: a fall past a rise is --choose-all's to find
    words = " ".join(res.stdout.split())
    assert "falls again further up, past a rise, is seen by --choose-all only" in words, words
    assert "a fall past a rise further up is found here only" in words, words


@pytest.mark.parametrize("name,n", [("micro", 1), ("weights", 1), ("mixed", 1)])
def test_time_per_sample_grows_with_the_count(jobs, name, n, monkeypatch):
    """The premise of ``variants_to_try``'s walk (up to the first count that
    fits and one more; docs/scaling.md, "the walk's trade-off"): each data
    and sharded setting's predicted time per sample never falls as the
    count grows, so no fall past a rise is left out. A net or a
    calibration where it does fall would fail here (and --choose-all
    would be the way to see it)."""
    _no_staged(monkeypatch)
    every = _every(jobs, name, n, 1)
    groups = {}
    for c in every.ranked:
        if c.error is None and c.unranked is None:
            groups.setdefault((c.variant_of or c).label, []).append(c)
    assert len(groups) >= 2
    for label, members in groups.items():
        seq = [_per_sample(c) for c in sorted(members, key=lambda c: c.micro or 1)]
        assert len(seq) >= 3 and seq == sorted(seq), (label, seq)
