"""What a pipeline did, read from its ranks' trace events (``Profiler``
events or ``train --profile`` files; the ranks share one time origin).

    busy_us(events)                      # union of a rank's compute intervals
    bubble_fraction(busy, span)          # idle share of the stages: 1 - mean(busy) / span
    theory_bubble(p, m)                  # GPipe / 1F1B: (p - 1) / (m + p - 1)
    live_micro_batches(events)           # peak micro-batches holding activations
    cross_stage_overlap_us(a, b)         # two ranks computing different micro-batches at once

Compute intervals are events of category ``compute``, ``update`` or
``copy`` (communication and the data reader's hand-over are not work a
stage does). A micro-batch copy's op is named ``<op>@mb<k>`` (micro_batch.py).
"""
import re

from ..runtime.trace import merge_intervals

WORK = ("compute", "update", "copy")
_MB = re.compile(r"@mb(\d+)(?:$|[.@])")


def micro_batch_of(name):
    """k for an op of micro-batch copy k (``fc1.fwd@mb2`` -> 2), else None."""
    m = _MB.search(name)
    return int(m.group(1)) if m else None


def _intervals(events, cats=WORK):
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"
            and e.get("cat") in cats]


def busy_us(events):
    """Microseconds during which at least one compute op of these events ran."""
    return sum(e - s for s, e in merge_intervals(_intervals(events)))


def bubble_fraction(busy, span):
    """Idle share of the stages over ``span``: 1 - mean(busy) / span."""
    return 1.0 - sum(busy) / (len(busy) * span) if busy and span > 0 else None


def theory_bubble(stages, micro_batches):
    """The bubble of a synchronous pipeline with equal stages: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def live_micro_batches(events, backward=lambda name: ".bwd." in name):
    """Peak number of micro-batches whose activations a rank holds at once:
    micro-batch k is live from the start of its first op on the rank to the
    end of its last backward op there (its activations are read until then).
    Returns (peak, {k: (start, end)})."""
    spans = {}
    for e in events:
        k = micro_batch_of(e.get("name", ""))
        if k is None or e.get("ph") != "X" or e.get("cat") not in WORK:
            continue
        start, end, bwd_end = spans.get(k, (float("inf"), float("-inf"), float("-inf")))
        start = min(start, e["ts"])
        end = max(end, e["ts"] + e["dur"])
        if backward(e["name"]):
            bwd_end = max(bwd_end, e["ts"] + e["dur"])
        spans[k] = (start, end, bwd_end)
    live = {k: (s, b if b > float("-inf") else e) for k, (s, e, b) in spans.items()}
    points = sorted([(s, 1) for s, _ in live.values()] + [(e, -1) for _, e in live.values()],
                    key=lambda x: (x[0], x[1]))
    peak = now = 0
    for _, step in points:
        now += step
        peak = max(peak, now)
    return peak, live


def cross_stage_overlap_us(a, b):
    """Microseconds during which rank ``a`` computes an op of micro-batch j
    while rank ``b`` computes one of micro-batch k != j: the stages working
    on different micro-batches at the same time (what pipelining is)."""
    by_mb = {}
    for name, events in (("a", a), ("b", b)):
        for e in events:
            k = micro_batch_of(e.get("name", ""))
            if k is not None and e.get("ph") == "X" and e.get("cat") in WORK:
                by_mb.setdefault((name, k), []).append((e["ts"], e["ts"] + e["dur"]))
    total = 0.0
    for (side, j), ia in by_mb.items():
        if side != "a":
            continue
        other = merge_intervals([iv for (s2, k), ivs in by_mb.items() if s2 == "b" and k != j
                       for iv in ivs])
        for s, e in merge_intervals(ia):
            for s2, e2 in other:
                total += max(0.0, min(e, e2) - max(s, s2))
    return total
