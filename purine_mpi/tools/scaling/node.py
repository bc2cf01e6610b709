"""Ranks that share a node: what ``predict --calibrate`` measures of them
and how the prediction applies it (``--ranks-per-node``).

Two effects a model of one rank and a link misses when several ranks run
on one host (docs/scaling.md, "Ranks sharing a node"):

- **compute contention**: each rank's ops run slower, its cores, memory
  bandwidth and caches shared with the other ranks of the node (and, as
  ``base/threads.py`` divides the cores among them, fewer host-product
  threads each). ``--calibrate`` times three kernel classes on 1 and on k
  concurrent ranks of one host (``calibrate.contention``): ``gemm``
  (host matrix products, ``ops/hostgemm.matmul`` at the threads a run of k
  ranks on the node picks), ``elementwise`` (memory-bound float32 sums and
  maxima over 4 MiB) and ``dispatch`` (a small op handed to a worker
  thread and back, an Event each way: the interpreter-bound work of the
  dispatcher and a thread's wake-up). ``compute_ratio[k][class]`` (k >= 2)
  is the median time a call takes at k ranks over the time alone.
- **collective completion**: a collective ends on a rank when the rank
  sees it finished; the dispatcher tests its requests every
  ``poll_interval`` while idle, and the peers must all be scheduled to
  progress it. ``collective_wait_s[k]`` is the mean time of a small
  Iallreduce over k ranks waited for the dispatcher's way, less the α–β
  model's time for it (at least 0): a fixed cost per collective beyond α.

The prediction at N ranks from a trace of T ranks, with K ranks per node
(``--ranks-per-node``; default the calibration's, else 1): the ranks on a
node are c_N = min(N, K) and the trace's c_T = min(T, K) (the traced ranks
ran on one host when K allows). A compute op of class ``x`` takes its
traced time × ratio[c_N][x] / ratio[c_T][x] (an op with FLOPs is
``gemm``, another ``elementwise``; the dispatcher's fitted cost per op and
per iteration ``dispatch``); a collective adds collective_wait_s[c_N] when
c_N >= 2 (or, with a calibration across hosts, whenever N >= 2). A k not
measured takes the largest measured below it (past the largest: the
largest, a lower bound where the slowdown grows with k; a file with no
ratios: 1), said in the output (``extrapolated``). A link without these measurements (an older file, the
defaults) applies none: the prediction is the one before.
"""
from dataclasses import dataclass, field

from ...base.errors import UserError

#: the kernel classes of the compute measurement
CLASSES = ("gemm", "elementwise", "dispatch")


@dataclass
class NodeModel:
    """The measurements of a link file's ``node`` block."""

    #: {k ranks on a node: {class: time at k / time alone}}
    compute_ratio: dict = field(default_factory=dict)
    #: {k ranks in the collective: seconds beyond the α–β model}
    collective_wait: dict = field(default_factory=dict)
    #: the calibration's ranks per host (the default of ``--ranks-per-node``)
    ranks_per_node: int = 1
    #: the calibration ran across hosts (its waits hold no sharing of a node)
    across_hosts: bool = False
    #: {k: seconds} of ``collective_wait``'s last part: from the test that
    #: saw the collective done until the worker runs (not in a traced span)
    handoff: dict = field(default_factory=dict)

    def ratio(self, cls, k):
        """(ratio of class ``cls`` at ``k`` ranks on a node, whether
        measured): 1 at k <= 1; the largest measured k's past it."""
        if k <= 1:
            return 1.0, True
        known = sorted(self.compute_ratio)
        if not known:
            return 1.0, False
        if k in self.compute_ratio:
            return float(self.compute_ratio[k][cls]), True
        below = [j for j in known if j < k]
        return float(self.compute_ratio[below[-1] if below else known[0]][cls]), False

    def wait(self, k, table=None):
        """(seconds per collective over ``k`` ranks, whether measured):
        ``collective_wait``, or ``table`` (``handoff``)."""
        table = self.collective_wait if table is None else table
        if k <= 1 or not table:
            return 0.0, k <= 1
        if k in table:
            return float(table[k]), True
        below = [j for j in sorted(table) if j < k]
        return float(table[below[-1] if below else min(table)]), False

    def as_dict(self):
        return {"ranks_per_node": self.ranks_per_node, "across_hosts": self.across_hosts,
                "compute_ratio": {str(k): dict(v) for k, v in sorted(self.compute_ratio.items())},
                "collective_wait_s": {str(k): v for k, v in sorted(self.collective_wait.items())},
                "handoff_s": {str(k): v for k, v in sorted(self.handoff.items())}}


def node_from_dict(data, path):
    """A NodeModel from a link file's ``node`` object; a UserError naming
    the file, the key (``node.compute_ratio.2.gemm``) and what is expected
    otherwise. Strict: a hand-edited figure that is not a finite JSON
    number in range (NaN, Infinity, a string, a boolean) is refused, not
    converted."""
    import math

    missing = object()

    def bad(key, expected, got):
        raise UserError(f"--link {path}: key '{key}': expected {expected} (written by "
                        "predict --calibrate), "
                        + ("it is missing" if got is missing else f"got {got!r}"))

    def number(key, v, least, above):
        """``v`` a finite number >= ``least`` (> where ``above``)."""
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < least or (above and v == least):
            bad(key, f"a finite number {'>' if above else '>='} {least:g}", v)
        return float(v)

    def table(key, least_k, required=False):
        """{k: value} of ``node.<key>``, k a whole number >= ``least_k``."""
        if key not in data and not required:
            return {}
        t = data.get(key, missing)
        if not isinstance(t, dict):
            bad(f"node.{key}", f"an object {{\"k\": ...}} (k >= {least_k} ranks)", t)
        out = {}
        for k, v in t.items():
            if not (isinstance(k, str) and k.isdigit() and int(k) >= least_k):
                bad(f"node.{key}", f"keys that are whole numbers of ranks >= {least_k}", k)
            out[int(k)] = v
        return out

    if not isinstance(data, dict):
        bad("node", "an object with compute_ratio, collective_wait_s, handoff_s, "
            "ranks_per_node and across_hosts", data)
    ratio = {}
    for k, v in table("compute_ratio", 2, required=True).items():
        if not isinstance(v, dict):
            bad(f"node.compute_ratio.{k}", f"an object of {', '.join(CLASSES)}", v)
        ratio[k] = {c: number(f"node.compute_ratio.{k}.{c}", v.get(c, missing), 0, True)
                    for c in CLASSES}
    wait = {k: number(f"node.collective_wait_s.{k}", v, 0, False)
            for k, v in table("collective_wait_s", 2).items()}
    handoff = {k: number(f"node.handoff_s.{k}", v, 0, False)
               for k, v in table("handoff_s", 2).items()}
    rpn = data.get("ranks_per_node", 1)
    if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
        bad("node.ranks_per_node", "a whole number >= 1", rpn)
    across = data.get("across_hosts", False)
    if not isinstance(across, bool):
        bad("node.across_hosts", "true or false", across)
    return NodeModel(ratio, wait, rpn, across, handoff)


@dataclass
class NodeScale:
    """The correction at one N: compute factors by class, the extra
    seconds per collective, and what was not measured (said in the output)."""

    factors: dict
    wait: float
    ranks_on_node: int
    traced_on_node: int
    extrapolated: bool = False
    #: seconds a traced collective takes beyond its traced span (the
    #: dispatcher's fit of a multi-rank trace: ``model.dispatch_overhead``)
    handoff: float = 0.0
    #: {j ranks of the node computing at once: {class: factor}} for j = 1 ..
    #: ranks_on_node (``by_busy``): where the trace ran alone on its node
    #: (``traced_on_node`` 1), ``concurrent.contended`` prices each compute op
    #: by how many of its node's ranks compute while it runs, not all of them
    by_busy: dict = field(default_factory=dict)

    def as_dict(self):
        return {"ranks_on_node": self.ranks_on_node, "traced_ranks_on_node": self.traced_on_node,
                "compute_factor": {c: round(v, 4) for c, v in self.factors.items()},
                "collective_wait_us": round(1e6 * self.wait, 2),
                "extrapolated": self.extrapolated}

    def dispatch(self, *seconds):
        """The dispatcher's fitted costs (``model.dispatch_overhead``: per
        op, per iteration, per comm op) at this N: each times the
        ``dispatch`` factor."""
        return tuple(s * self.factors["dispatch"] for s in seconds)


NONE = NodeScale({c: 1.0 for c in CLASSES}, 0.0, 1, 1)


def node_scale(node, n, traced_ranks, ranks_per_node):
    """The NodeScale of ``n`` ranks from a trace of ``traced_ranks``,
    ``ranks_per_node`` ranks a node (the module docstring); ``NONE``
    (nothing changes) where ``node`` is None."""
    if node is None:
        return NONE
    k = max(1, int(ranks_per_node))
    c_n, c_t = min(int(n), k), min(int(traced_ranks), k)
    factors, exact = {}, True
    for cls in CLASSES:
        (a, ea), (b, eb) = node.ratio(cls, c_n), node.ratio(cls, c_t)
        factors[cls] = a / b
        exact = exact and ea and eb
    wait = handoff = 0.0
    if n >= 2 and (c_n >= 2 or node.across_hosts):
        k = int(n) if node.across_hosts else c_n
        wait, ew = node.wait(k)
        handoff = node.wait(k, node.handoff)[0]
        exact = exact and ew
    by_busy = {j: {cls: node.ratio(cls, j)[0] / node.ratio(cls, c_t)[0] for cls in CLASSES}
               for j in range(1, c_n + 1)}
    return NodeScale(factors, wait, c_n, c_t, not exact, handoff, by_busy)


def parse_ranks_per_node(given):
    """``--ranks-per-node K`` as given on the command line (``plan``'s and
    ``predict``'s alike): None where not given, else K, a whole number >= 1;
    anything else one line naming the option and the value (exit 2)."""
    if given is None:
        return None
    try:
        k = int(str(given).strip())
    except ValueError:
        k = 0
    if k < 1:
        raise UserError(f"--ranks-per-node {given}: expected a whole number >= 1")
    return k


def ranks_per_node_of(link, given=None):
    """K, the ranks a node: ``given`` (``--ranks-per-node``), else the link
    file's calibration's ranks per host, else 1."""
    if given is not None:
        return int(given)
    return link.node.ranks_per_node if link.node is not None else 1


def scales(link, traced_ranks, ranks_per_node=None):
    """(K, {N: the NodeScale at N, or None without measurements}) as a
    function of N: the correction ``predict`` and ``plan --choose`` apply
    (``model.predict_table``, ``choose.Predictor``) to a trace of
    ``traced_ranks`` on ``link`` (its ``node``; None: no correction),
    ``ranks_per_node`` as ``ranks_per_node_of`` reads it."""
    k = ranks_per_node_of(link, ranks_per_node)

    def scale(n):
        return None if link.node is None else node_scale(link.node, n, traced_ranks, k)
    return k, scale


def notes(link, ranks_per_node, link_name=None, given=False):
    """The notes (stderr, once) of what the correction cannot apply:
    ``link`` (``link_name``: the option and file it came from, None: the
    defaults) holds no ``node`` measurements; or it holds no compute ratios
    (a calibration with one rank a host) while K = ``ranks_per_node`` > 1.
    ``given``: K was given (``--ranks-per-node``)."""
    if link.node is None:
        if link_name is None and not given:
            return []
        return [f"note: {link_name or 'the link'} holds no measurement of ranks sharing a "
                "node (written before predict --calibrate measured it, or no link file): "
                "each rank is priced as its trace ran, whatever --ranks-per-node; run "
                "predict --calibrate again to measure it"]
    if ranks_per_node > 1 and not link.node.compute_ratio:
        return [f"note: {link_name or 'the link'} was calibrated with one rank a host: "
                f"it measured no ranks sharing a host, so at {ranks_per_node} ranks a node "
                "each op is "
                "priced as its trace ran (calibrate with several ranks a host to measure "
                "it: mpiexec -n 2 on one host)"]
    return []
