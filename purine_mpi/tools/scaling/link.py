"""The network model of the scaling predictor: what a collective or a
point-to-point transfer of B bytes costs at N ranks on a link with latency
α (seconds), bandwidth β (bytes per second) and a per-byte CPU cost γ
(seconds per byte the rank reduces: the reduction arithmetic and the copies
the transport makes, measured by ``predict --calibrate``).

Allreduce of B bytes over N ranks (Thakur, Rabenseifner and Gropp, "Optimization
of collective communication operations in MPICH", IJHPCA 2005):

    ring          2(N-1)·α + 2(N-1)/N · B/β + (N-1)/N · B·γ
    tree          recursive doubling: log2 P · (α + B/β + B·γ)
    rabenseifner  reduce-scatter + allgather:
                  2·log2 P · α + 2(P-1)/P · B/β + (P-1)/P · B·γ
    auto          MPICH's choice by size: tree up to 2,048 bytes
                  (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE), rabenseifner above

where P is the largest power of two <= N; when P < N, tree and
rabenseifner add the fold of the extra ranks, 2·(α + B/β).

ReduceScatter and Allgather of a buffer of B bytes over N ranks (the
sharded scheme's collectives; B is the whole buffer, each rank ends with,
or starts from, its B/N shard), each half of the allreduce's traffic:

    ring          (N-1)·α + (N-1)/N · B/β [+ (N-1)/N · B·γ: reduce-scatter]
    tree, auto    recursive halving (reduce-scatter) / doubling (allgather):
                  ⌈log2 N⌉·α + (N-1)/N · B/β [+ (N-1)/N · B·γ]

(MPICH's recursive halving and doubling for a power of two, its pairwise
exchange or Bruck's algorithm otherwise: every one moves (N-1)/N · B per
rank; the latency terms are these algorithms' rounds). A
point-to-point message costs α + B/β; a one-sided transfer (Put, Get into
or out of a window: no receive posted, no matching, no copy at the
receiver) α_put + B/β_put, the figures ``predict --calibrate`` measures
with ``MPI_Put`` beside ``MPI_Send`` (α and β where they are not given).

Ranks sharing a node (``shared_node``, ``plan --choose``): where the link's
transfer CPU was not measured, each byte a rank sends to a rank of its own
node (``local_ranks`` a node, in rank order) costs it the copies MPI's
shared-memory transport makes (``SHARED_MEMORY_COPIES``) at the host's
copy rate (``copy_cost_per_byte``), taken from its compute; a one-sided
Put or Get one copy, the origin's; a byte to another node none (RDMA). A
collective's share of same-node bytes follows its algorithm's partners
above (``same_node_share``).
"""
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from ...base.errors import UserError

ALGORITHMS = ("ring", "tree", "auto")
#: MPICH's MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE default (bytes)
SHORT_MSG = 2048

#: the default link when neither --bandwidth/--latency nor --link is given
DEFAULT_ORIGIN = ("defaults: 100 Gbit/s InfiniBand, α 1 µs and β 12 GB/s (the order of the "
                  "OSU micro-benchmark figures vendors publish for EDR/HDR100; docs/scaling.md), "
                  "γ measured on this host")
DEFAULT_ALPHA = 1.0e-6
DEFAULT_BETA = 12.0e9


@dataclass
class Link:
    """α (s), β (bytes/s), γ (s per reduced byte), where they come from, and
    two terms of a transfer that runs while the rank computes (measured by
    ``predict --calibrate``; 0 and β by default: a free core, RDMA):
    ``cpu`` (s per byte sent: the wall time the transfer takes from the
    compute lanes) and ``beta_busy`` (the rate meanwhile)."""

    alpha: float
    beta: float
    gamma: float = 0.0
    origin: str = ""
    cpu: float = 0.0
    beta_busy: float = None
    alpha_put: float = None  # a one-sided transfer's latency and bandwidth
    beta_put: float = None   # (None: those of a message)
    #: γ was timed when this Link was made (``make_link`` without a link
    #: file or a given γ): ``plan --choose`` takes the calibration's instead
    gamma_measured: bool = False
    #: ranks sharing a node (``node.NodeModel``: compute contention and the
    #: wait per collective, measured by ``predict --calibrate``); None: not
    #: measured (an older link file, the defaults), no correction
    node: object = None
    #: ``cpu`` is a measurement (a ``predict --calibrate`` file, 0 there
    #: meaning a free core or RDMA), not the defaults' 0: ``shared_node``
    #: leaves it as it is
    cpu_measured: bool = False
    #: ranks a node, placed in rank order (``plan.host_ranks``' blocks),
    #: where ``cpu`` is the shared-memory copies (``shared_node``): only a
    #: transfer between two ranks of one node pays it, RDMA across nodes
    #: takes none; None: ``cpu`` is the link's, every byte sent pays it
    local_ranks: int = None

    def busy(self):
        """This link as it runs while the rank computes (β_busy for β)."""
        if not self.beta_busy or self.beta_busy >= self.beta:
            return self
        return replace(self, beta=self.beta_busy, beta_busy=None, gamma_measured=False)

    def same_node(self, a, b):
        """Whether ranks ``a`` and ``b`` share a node (``local_ranks`` a
        node, in rank order; every pair where that is not known)."""
        k = self.local_ranks
        return k is None or int(a) // k == int(b) // k

    def collective_cpu(self, members, nbytes, algorithm="auto", halves=2):
        """Seconds of ``cpu`` a rank pays for a collective of ``nbytes``
        over the ranks ``members`` (in the group's order): ``cpu`` on the
        bytes it sends (``sent_bytes``), where ``local_ranks`` is set only
        on their share that goes to a rank of its own node
        (``same_node_share``: the algorithm's partners)."""
        members = tuple(int(m) for m in members)
        sent = self.sent_bytes(len(members), float(nbytes), halves)
        if self.local_ranks is None:
            return self.cpu * sent
        nodes = tuple(m // self.local_ranks for m in members)
        return self.cpu * sent * same_node_share(nodes, algorithm, nbytes, halves)

    def send_cpu(self, rank, peer, nbytes):
        """Seconds of ``cpu`` a two-sided send of ``nbytes`` from ``rank``
        to ``peer`` costs its sender: none across nodes (``local_ranks``)."""
        return self.cpu * nbytes if self.same_node(rank, peer) else 0.0

    def one_sided_cpu(self, kind, rank, peer, nbytes):
        """Seconds of ``cpu`` a one-sided op ``kind`` (Put, Get, Publish)
        of ``nbytes`` costs ``rank``, whose peer is ``peer``. Where ``cpu``
        is the shared-memory copies (``local_ranks``): one copy
        (``cpu / SHARED_MEMORY_COPIES``), the origin's -- a Put writes the
        target's window, a Get reads it, no receiver copies out -- where
        the peer shares its node, none across nodes (RDMA); a Publish
        copies into the rank's own region: one copy. A measured ``cpu``
        (a send's, ``predict --calibrate``) prices a Put or Publish as a
        send and a Get at nothing."""
        if self.local_ranks is None:
            return self.cpu * nbytes if kind in ("Put", "Publish") else 0.0
        if kind == "Publish" or (kind in ("Put", "Get") and self.same_node(rank, peer)):
            return self.cpu / SHARED_MEMORY_COPIES * nbytes
        return 0.0

    def put(self, nbytes):
        """Seconds of a one-sided transfer of ``nbytes`` (Put or Get)."""
        alpha = self.alpha if self.alpha_put is None else self.alpha_put
        return alpha + nbytes / (self.beta_put or self.beta)

    def get_shards(self, n, nbytes):
        """Seconds for a rank to read the other ``n - 1`` owners' shards of
        a ``nbytes`` buffer by one-sided Gets posted at once (ZeRO stage 3
        across hosts): one latency, (N-1)/N of the bytes at the window's
        rate; the owners spend nothing."""
        n = int(n)
        return self.put((n - 1) / n * float(nbytes)) if n > 1 else 0.0

    def barrier(self, n):
        """Seconds for a barrier over ``n`` ranks (MPICH's dissemination
        barrier: ⌈log2 n⌉ rounds of a zero-byte message)."""
        n = int(n)
        return (n - 1).bit_length() * self.alpha if n > 1 else 0.0

    @staticmethod
    def sent_bytes(n, nbytes, halves=2):
        """Bytes a rank sends in an allreduce of ``nbytes`` over ``n`` ranks
        (ring or reduce-scatter + allgather): 2(N-1)/N of the message;
        ``halves=1``: a reduce-scatter's or an allgather's (N-1)/N."""
        return halves * (n - 1) / n * nbytes if n > 1 else 0.0

    def p2p(self, nbytes):
        return self.alpha + nbytes / self.beta

    def allreduce(self, n, nbytes, algorithm="auto"):
        """Seconds for an allreduce of ``nbytes`` over ``n`` ranks."""
        n = int(n)
        if n <= 1:
            return 0.0
        _check_algorithm(algorithm)
        b = float(nbytes)
        if algorithm == "ring":
            return 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * b / self.beta + \
                (n - 1) / n * b * self.gamma
        pof2 = 1 << (n.bit_length() - 1)  # the largest power of two <= n
        lg = pof2.bit_length() - 1
        fold = 0.0 if pof2 == n else 2 * (self.alpha + b / self.beta)
        if algorithm == "tree" or b <= SHORT_MSG:
            return lg * (self.alpha + b / self.beta + b * self.gamma) + fold
        return 2 * lg * self.alpha + 2 * (pof2 - 1) / pof2 * b / self.beta + \
            (pof2 - 1) / pof2 * b * self.gamma + fold

    def reduce_scatter(self, n, nbytes, algorithm="auto"):
        """Seconds for a reduce-scatter of a ``nbytes`` buffer over ``n``
        ranks (each rank's shard of the sum: the reduction's γ on
        (N-1)/N of the bytes)."""
        return self._half(n, nbytes, algorithm, self.gamma)

    def allgather(self, n, nbytes, algorithm="auto"):
        """Seconds for an allgather of a ``nbytes`` buffer (the whole,
        every rank's shard) over ``n`` ranks: no reduction."""
        return self._half(n, nbytes, algorithm, 0.0)

    def _half(self, n, nbytes, algorithm, gamma):
        n = int(n)
        if n <= 1:
            return 0.0
        _check_algorithm(algorithm)
        b = float(nbytes)
        rounds = n - 1 if algorithm == "ring" else (n - 1).bit_length()  # ⌈log2 n⌉
        return rounds * self.alpha + (n - 1) / n * b / self.beta + (n - 1) / n * b * gamma

    def as_dict(self):
        out = asdict(self)
        out["node"] = None if self.node is None else self.node.as_dict()
        return out


def _check_algorithm(algorithm):
    """A UserError naming ``--algorithm`` unless it is one of ALGORITHMS."""
    if algorithm not in ALGORITHMS:
        raise UserError(f"--algorithm: expected one of {', '.join(ALGORITHMS)}, "
                        f"got {algorithm!r}")


_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
               "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "b/s": 1.0, "": 1 / 8}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_rate(text):
    """``1gbit`` / ``250mbit`` / ``100gbit`` (tc's units: bits per second;
    ``kbps``/``mbps``/``gbps`` are bytes per second, as tc reads them) ->
    bytes per second. A UserError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z/]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    rate = float(m.group(1)) * _RATE_UNITS[unit] if m and unit in _RATE_UNITS else None
    # a figure past float's range (1e999gbit) reads as infinite: no rate
    if rate is None or not 0 < rate < math.inf:
        raise UserError(f"--bandwidth: expected a rate such as 1gbit, 250mbit or 100gbit "
                        f"(bits per second; kbps/mbps/gbps: bytes per second), got {text!r}")
    return rate


def parse_time(text):
    """``20us`` / ``1.5ms`` / ``0`` -> seconds. A UserError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zµ]*)\s*", str(text))
    unit = (m.group(2) or "s") if m else None
    seconds = float(m.group(1)) * _TIME_UNITS[unit] if m and unit in _TIME_UNITS else None
    # a figure past float's range (1e999s) reads as infinite: no time
    if seconds is None or not math.isfinite(seconds):
        raise UserError(f"--latency: expected a time such as 20us, 1.5ms or 0, got {text!r}")
    return seconds


def reduce_cost_per_byte(nbytes=1 << 22, repeats=5):
    """Seconds per byte of a float32 elementwise sum on this host (the
    reduction an allreduce does on every byte it receives): the median of
    ``repeats`` sums of two ``nbytes`` arrays."""
    import time

    import numpy as np
    a = np.ones(nbytes // 4, np.float32)
    b = np.ones_like(a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.add(a, b, out=a)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] / nbytes


#: the copies MPI's shared-memory transport makes of each byte sent between
#: two ranks of one node (MPICH's shm cells: the sender copies into them, the
#: receiver out of them), each on a rank's own cores
SHARED_MEMORY_COPIES = 2

#: the buffer ``copy_cost_per_byte`` copies: larger than a host's last-level
#: cache, as a bucket's transfer streams its multi-MB buffers through memory
COPY_BYTES = 32 << 20


def copy_cost_per_byte(nbytes=COPY_BYTES, repeats=5):
    """Seconds per byte of a float32 copy of ``nbytes`` on this host (the
    median of ``repeats`` copies, after one that touches the pages)."""
    import time
    import numpy as np
    a = np.ones(nbytes // 4, np.float32)
    b = np.zeros_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] / nbytes


def shared_node(link, ranks_on_node, copy_cost):
    """``link`` for ranks that share a node (``ranks_on_node`` >= 2) whose
    cores their compute fills (base/threads divides a host's cores among
    its ranks): a transfer between them is copied by the ranks' own cores,
    ``SHARED_MEMORY_COPIES`` times at the host's ``copy_cost`` (seconds
    per byte), and that CPU comes out of their compute: ``cpu`` per byte
    sent. Unchanged where ``cpu`` was measured (``cpu_measured``: a
    ``predict --calibrate`` file, which measures the transfer's CPU on the
    link itself) or one rank a node."""
    if link.cpu_measured or ranks_on_node < 2 or not copy_cost or copy_cost <= 0:
        return link
    return replace(link, cpu=SHARED_MEMORY_COPIES * float(copy_cost),
                   local_ranks=int(ranks_on_node))


def same_node_share(nodes, algorithm="auto", nbytes=0, halves=2):
    """The share of the bytes a rank sends in a collective that go to a
    rank of its own node, averaged over the group's ranks, whose nodes
    ``nodes`` gives in the group's order, by the partners of the
    algorithms ``Link`` prices (``halves`` 2: an allreduce, 1: a
    reduce-scatter or allgather):

    ring            each rank sends all to the next: the share of ranks
                    whose next (the last's: the first) is on its node,
                    (N - nodes)/N at K a node in blocks (N > K)
    tree            an allreduce of ``tree`` (or ``auto`` up to
                    SHORT_MSG), recursive doubling: log2 N rounds of all
                    the bytes, round i to rank r XOR 2^i
    auto            an allreduce above SHORT_MSG, Rabenseifner's
                    (MPICH's reduce-scatter + allgather inside it): the
                    rank 2^i away takes B/2^(i+1), so at K a node (a power
                    of two, blocks) (1 - 1/K)/(1 - 1/N) stay on the node
    halves          a reduce-scatter's recursive halving (MPICH: the
                    first half sends the second half of the data to the
                    other half, p/2 away) or an allgather's recursive
                    doubling (the exchange with the rank 2^i away doubles):
                    the rank 2^i away takes 2^i/N of B, (K - 1)/(N - 1)

    N not a power of two (MPICH's fold, pairwise exchange, Bruck): every
    other rank alike, the share of pairs on one node. 1 where every rank
    shares one node, 0 where none does."""
    if halves != 2:
        pattern = "halves"
    elif algorithm == "tree" or nbytes <= SHORT_MSG:
        pattern = "tree"
    else:
        pattern = "allreduce"
    return _share(tuple(nodes), algorithm, pattern)


@lru_cache(maxsize=4096)
def _share(nodes, algorithm, pattern):
    n = len(nodes)
    if n < 2 or len(set(nodes)) == 1:
        return 1.0
    if len(set(nodes)) == n:
        return 0.0
    if algorithm == "ring":
        return sum(nodes[i] == nodes[(i + 1) % n] for i in range(n)) / n
    if n & (n - 1):  # not a power of two: any other rank alike
        pairs = sum(a == b for a in nodes for b in nodes) - n  # ordered, not with itself
        return pairs / (n * (n - 1))
    lg = n.bit_length() - 1
    # the share of the bytes that goes to the rank 2^i away
    weight = [1 / lg if pattern == "tree" else
              2.0 ** -(i + 1) / (1 - 1 / n) if pattern == "allreduce" else
              2.0 ** i / (n - 1) for i in range(lg)]
    return sum(w for r in range(n) for i, w in enumerate(weight)
               if nodes[r] == nodes[r ^ (1 << i)]) / n


def make_link(bandwidth=None, latency=None, link_file=None, gamma=None):
    """The Link of the command line: ``--link FILE`` (a calibration), else
    the default 100 Gbit/s InfiniBand figures, with ``--bandwidth`` and
    ``--latency`` replacing theirs."""
    if link_file:
        link = load_link(link_file)
    else:
        link = Link(DEFAULT_ALPHA, DEFAULT_BETA,
                    reduce_cost_per_byte() if gamma is None else gamma, DEFAULT_ORIGIN,
                    gamma_measured=gamma is None)
    parts = []
    if bandwidth is not None:
        link.beta = parse_rate(bandwidth)
        parts.append(f"β = {bandwidth} (--bandwidth)")
    if latency is not None:
        link.alpha = parse_time(latency)
        parts.append(f"α = {latency} (--latency)")
    if parts:
        link.origin = "; ".join(parts) + "; the rest: " + link.origin
    return link


FORMAT = "purine_mpi.link"


def save_link(path, link, extra=None):
    data = {"format": FORMAT, "alpha_s": link.alpha, "beta_bytes_per_s": link.beta,
            "gamma_s_per_byte": link.gamma, "cpu_s_per_byte": link.cpu,
            "beta_busy_bytes_per_s": link.beta_busy, "alpha_put_s": link.alpha_put,
            "beta_put_bytes_per_s": link.beta_put, "origin": link.origin}
    if link.node is not None:
        data["node"] = link.node.as_dict()
    data.update(extra or {})
    # its folder made and the file replaced whole (base/runfiles): never
    # written through a link planted there, never half-written; a folder
    # that cannot be made or a full disk is one line naming it (exit 2)
    from ...base.runfiles import make_parent, write_text_replacing
    make_parent(path, "--calibrate")  # predict --calibrate LINK.json: its one writer
    write_text_replacing(path, json.dumps(data, indent=1) + "\n")
    return path


def load_link(path):
    """A Link from a ``predict --calibrate`` file; a UserError naming the
    file and what is wrong otherwise."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise UserError(f"--link {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise UserError(f"--link {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"--link {path}: not a link file (written by predict --calibrate: "
                        f"\"format\": \"{FORMAT}\")")
    try:
        alpha, beta = float(data["alpha_s"]), float(data["beta_bytes_per_s"])
        gamma = float(data.get("gamma_s_per_byte", 0.0))
        cpu = float(data.get("cpu_s_per_byte", 0.0))
        busy = data.get("beta_busy_bytes_per_s")
        busy = None if busy is None else float(busy)
        put = [data.get(k) for k in ("alpha_put_s", "beta_put_bytes_per_s")]
        put = [None if v is None else float(v) for v in put]
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"--link {path}: key {exc}: expected numbers alpha_s, "
                        "beta_bytes_per_s, gamma_s_per_byte, cpu_s_per_byte and "
                        "beta_busy_bytes_per_s") from None
    # JSON's Infinity and NaN read as floats: a figure must be finite too
    # (an infinite latency never lets the simulated iteration end)
    finite = all(math.isfinite(v) for v in (alpha, beta, gamma, cpu, busy, *put)
                 if v is not None)
    if not (finite and alpha >= 0 and beta > 0 and gamma >= 0 and cpu >= 0
            and (busy is None or busy > 0)
            and (put[0] is None or put[0] >= 0) and (put[1] is None or put[1] > 0)):
        raise UserError(f"--link {path}: expected finite numbers alpha_s >= 0, "
                        "beta_bytes_per_s > 0, "
                        "gamma_s_per_byte >= 0, cpu_s_per_byte >= 0, "
                        "beta_busy_bytes_per_s > 0, alpha_put_s >= 0 and "
                        "beta_put_bytes_per_s > 0")
    from .node import node_from_dict
    node = node_from_dict(data["node"], path) if data.get("node") is not None else None
    return Link(alpha, beta, gamma, data.get("origin") or f"calibrated ({path})", cpu, busy,
                alpha_put=put[0], beta_put=put[1], node=node,
                cpu_measured="cpu_s_per_byte" in data)
