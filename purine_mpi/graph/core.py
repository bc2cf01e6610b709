"""The bi-graph: blobs (tensors) and ops (operators) joined by edges.

A blob is written by at most one op per iteration (single assignment), except
when every writer declares ``accumulate`` (then the blob is zeroed before the
iteration and writers add into it). State that persists across iterations
(weights, momentum) is updated through *alias* blobs: ``conv1/weight@new``
aliases the storage of ``conv1/weight``; its writer runs only after every
other reader of the storage has finished (a write-after-read edge), so a
graph stays acyclic and the dispatcher never races a reader with an update.
"""
import copy as _copy
import heapq
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..base.errors import GraphError, ShapeError
from ..base.precision import SHORT
from ..base.shared_answers import SharedAnswers


@dataclass(frozen=True)
class Location:
    """Where a node lives: an MPI rank (or host ``ip``) and a device (-1 = CPU)."""

    rank: int = 0
    device: int = -1
    ip: Optional[str] = None

    def to_dict(self):
        d = {"rank": self.rank, "device": self.device}
        if self.ip is not None:
            d["ip"] = self.ip
        return d


CPU = Location()


@dataclass
class Blob:
    """A tensor node. ``alias_of`` names the blob whose storage this one shares
    (``offset`` elements in); ``kind`` is one of data/param/grad/state/lr/iter."""

    name: str
    shape: Optional[tuple] = None
    dtype: str = "float32"
    location: Location = CPU
    kind: str = "data"
    alias_of: Optional[str] = None
    offset: int = 0
    attrs: dict = field(default_factory=dict)

    @property
    def size(self):
        # math.prod, not np.prod: a graph pass asks this of every blob pair
        # that shares storage (Graph.dependencies' overlap test), and NumPy's
        # reduction of a small tuple costs ~20x more (a third of a
        # composition's time, measured on ``plan --choose``); exact ints
        return int(math.prod(self.shape)) if self.shape is not None else None

    @property
    def nbytes(self):
        return self.size * np.dtype(self.dtype).itemsize

    def copy(self, **changes):
        """What ``copy.deepcopy`` gives, with the ``changes`` (fields) set:
        several times faster (a composition copies each blob per rank and
        per micro-batch). Nothing mutable is shared (``attrs`` is copied
        deeply); a frozen Location, a str, a tuple of ints are values."""
        return _copy_node(self, changes)


@dataclass
class Op:
    """An operator node: reads ``inputs`` and writes ``outputs`` (blob names)."""

    name: str
    op_type: str
    inputs: list
    outputs: list
    attrs: dict = field(default_factory=dict)
    location: Location = CPU
    thread: object = 0
    accumulate: bool = False
    #: extra predecessor ops (by name) beyond the data edges
    control_inputs: list = field(default_factory=list)

    def copy(self, **changes):
        """What ``copy.deepcopy`` gives, with the ``changes`` (fields) set
        (Blob.copy's, for the ops)."""
        return _copy_node(self, changes)


#: values a deep copy may share: immutable
_ATOMS = (str, int, float, bool, type(None), Location, np.generic)


def _copy_node(node, changes):
    """A Blob or Op as ``copy.deepcopy(node)`` makes it, with ``changes``
    set: each attribute shared where it is an atom or a tuple of atoms,
    else copied deeply; the ones ``changes`` sets are not copied."""
    unknown = set(changes) - set(node.__dict__)
    if unknown:
        raise TypeError(f"{type(node).__name__} has no field {sorted(unknown)[0]!r}")
    new, memo = object.__new__(type(node)), {}
    for name, value in node.__dict__.items():
        if name in changes:
            value = changes[name]
        elif not _is_atom(value):
            value = copy_value(value, memo)
        new.__dict__[name] = value
    return new


def _is_atom(value):
    """Whether a deep copy may share ``value``: an atom or a tuple of atoms."""
    return isinstance(value, _ATOMS) or (type(value) is tuple and all(
        isinstance(v, _ATOMS) for v in value))


def copy_value(value, memo=None):
    """``copy.deepcopy(value, memo)``, several times faster for what nodes
    hold most: a dict (of str keys) or a list whose items are atoms or
    tuples of atoms is copied one level (the items shared, as a deep copy
    would share them); anything else, and a value ``memo`` has met (the
    same object twice keeps being one object), as deepcopy does it. An
    op's ``attrs`` are copied for every micro-batch copy: 32 copies of
    GPT-2 124M's per-sample ops and blobs, ~22,000 dicts a rank."""
    if memo is None:
        memo = {}
    got = memo.get(id(value), memo)
    if got is not memo:
        return got
    kind = type(value)
    if kind is dict and all(type(k) is str for k in value) and \
            all(_is_atom(v) for v in value.values()):
        out = dict(value)
    elif kind is list and all(_is_atom(v) for v in value):
        out = list(value)
    else:
        return _copy.deepcopy(value, memo)
    memo[id(value)] = out   # ``value`` lives on in the node copied
    return out


#: graph -> (its ``_dependency_inputs``, its ``_dependencies``) of the last
#: ``Graph.dependencies`` call: kept beside the graph, not in it (a copy
#: or a pickle of a graph carries none)
_LAST_DEPENDENCIES = weakref.WeakKeyDictionary()
#: graph -> (its op names, the dependencies, its ``topo_order`` as names)
#: of the last ``Graph.topo_order`` call: kept beside the graph, as
#: ``_LAST_DEPENDENCIES``
_LAST_ORDER = weakref.WeakKeyDictionary()
#: the answers ``shared_dependencies`` keeps, by ``_dependency_inputs``
#: (each holds its graph's names and edges: about 1 MB for a graph of a
#: few thousand ops), the last 64 within ``SHARED_DEPENDENCIES_BYTES``
def _dependencies_weight(key, deps):
    """About the bytes a kept ``dependencies`` answer holds with its key
    (``_dependency_inputs``): ~400 per op, ~150 per blob, ~60 per edge
    (tracemalloc on gpt_small at 16 micro-batches, 4,652 ops, 6,278 blobs,
    19,852 edges: 4.0 MB; at 4 micro-batches 0.6 MB, under the estimate)."""
    return 400 * len(key[0]) + 150 * len(key[1]) + 60 * sum(len(d) for d in deps.values())


#: the most bytes the kept answers of ``shared_dependencies`` hold together
#: (besides their count): ``plan --choose`` on 32 micro-batches of GPT-2
#: 124M keeps answers of ~20 MB each
SHARED_DEPENDENCIES_BYTES = 256 << 20
#: each kept answer is (the dependencies, [None, or (op names, their
#: topological order)]): ``topo_order`` sorts a content's ops once
SHARED_DEPENDENCIES = SharedAnswers(64, SHARED_DEPENDENCIES_BYTES,
                                    lambda key, kept: _dependencies_weight(key, kept[0]))


def shared_dependencies():
    """Within it, ``Graph.dependencies`` keeps the answers of the last
    ``SHARED_DEPENDENCIES.size`` graphs by their content, not by graph: a
    graph of the content of one asked of before (a copy, another rank's
    or another setting's composition of the same net, an edit undone)
    takes its answer (``plan --choose``: 3 in 4 computations were of a
    content asked of before). Kept only while it is open (a command
    that composes many graphs), so that a run holds no graph's answer
    beyond its graphs' own."""
    return SHARED_DEPENDENCIES.opened()


#: a kernel's output dtype (a name, a NumPy type or dtype) -> its NumPy name
_DTYPE_NAMES = {}


def _dtype_name(dtype):
    """``str(np.dtype(dtype))``, kept per ``dtype`` (4-12 us each):
    ``infer_shapes`` names every output of every op of every graph it is
    given, ~58,000 names to sweep one layout's settings offline."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        return _DTYPE_NAMES.setdefault(dtype, str(np.dtype(dtype)))
    except TypeError:  # not hashable
        return str(np.dtype(dtype))

#: blob kinds whose storage persists across iterations (the memory plan
#: gives them no arena slot; the recompute pass never recomputes them).
#: ``param_copy``: a weight's low-precision copy that its update writes
#: (parallel/precision.fold_weight_casts), read by the next iteration
PERSISTENT_KINDS = ("param", "param_buffer", "state", "lr", "iter", "bucket", "param_copy")

#: blob attr of a full (gathered or not yet reduce-scattered) bucket that a
#: ZeRO stage makes transient (parallel/sharding.py): the model state's
#: working set, not held state; the memory plan places it in the arena
#: though views of it (the weights) have a persistent kind
WORKING_SET_ATTR = "model_state_working_set"


class Graph:
    """Blobs and ops with the adjacency the dispatcher and passes need."""

    #: whether a deferred tail (runtime/tail.py) may run the last updates into
    #: the next iteration (a tensor-parallel composition: never)
    deferrable = True
    #: the micro-batch memory plan (parallel/micro_memory.py), or None
    memory_plan = None
    #: the activation recompute pass's summary (graph/recompute.py), or None
    recompute = None

    def __init__(self, name="net"):
        self.name = name
        self.blobs = {}
        self.ops = {}  # insertion-ordered: the order ops were emitted

    # ------------------------------------------------------------ building
    def free_name(self, base):
        """``base``, or ``base#k`` with the smallest k >= 1 that names no
        blob and no op yet (for blobs and ops a composition inserts)."""
        name, k = base, 1
        while name in self.blobs or name in self.ops:
            name = f"{base}#{k}"
            k += 1
        return name

    def add_blob(self, name, shape=None, dtype="float32", location=None, kind="data",
                 exist_ok=False, **kw):
        if name in self.blobs:
            if exist_ok:
                return self.blobs[name]
            raise GraphError(f"blob '{name}' is defined twice")
        blob = Blob(name, tuple(shape) if shape is not None else None, str(dtype),
                    location or CPU, kind, **kw)
        self.blobs[name] = blob
        return blob

    def add_op(self, name, op_type, inputs, outputs, attrs=None, location=None,
               thread=0, accumulate=False, control_inputs=()):
        if name in self.ops:
            raise GraphError(f"op '{name}' is defined twice")
        op = Op(name, op_type, list(inputs), list(outputs), dict(attrs or {}),
                location or CPU, thread, accumulate, list(control_inputs))
        for b in op.inputs + op.outputs:
            if b not in self.blobs:
                self.add_blob(b, location=op.location)
        self.ops[name] = op
        return op

    def remove_op(self, name):
        del self.ops[name]

    def copy(self):
        import copy
        return copy.deepcopy(self)

    # ----------------------------------------------------------- adjacency
    def producers(self):
        """blob name -> list of ops that write it."""
        prod = defaultdict(list)
        for op in self.ops.values():
            for b in op.outputs:
                prod[b].append(op)
        return prod

    def consumers(self):
        """blob name -> list of ops that read it."""
        cons = defaultdict(list)
        for op in self.ops.values():
            for b in op.inputs:
                cons[b].append(op)
        return cons

    def storage_root(self, name):
        """The blob that owns ``name``'s memory (follows alias chains)."""
        seen = set()
        while self.blobs[name].alias_of is not None:
            if name in seen:
                raise GraphError(f"alias cycle through blob '{name}'")
            seen.add(name)
            name = self.blobs[name].alias_of
        return name

    def storage_roots(self):
        """{blob name: ``storage_root``} of every blob, in the blobs' order:
        a blob that aliases none is its own (most blobs: no walk, no call)."""
        return {b: b if blob.alias_of is None else self.storage_root(b)
                for b, blob in self.blobs.items()}

    def dependencies(self):
        """op name -> set of predecessor op names: data edges (read after
        write), write-after-read edges for alias writers, control inputs.
        A new dict of new sets on each call (the caller may change them);
        computed again only when what it is computed from changed
        (``_dependency_inputs``): graph passes edit a graph in place and
        ask for its order after each edit, most often of an unchanged one
        (within ``shared_dependencies``, only for a content unlike that of
        the graphs asked last)."""
        return {n: set(d) for n, d in self._dependency_answer().items()}

    def _dependency_answer(self):
        """``dependencies``' kept answer itself (not to be changed)."""
        inputs = self._dependency_inputs()
        last = _LAST_DEPENDENCIES.get(self)
        if last is None or last[0] != inputs:
            last = (inputs, *SHARED_DEPENDENCIES.answer(
                lambda: inputs, lambda: (self._dependencies(), [None])))
            _LAST_DEPENDENCIES[self] = last
        return last[1]

    def _dependency_inputs(self):
        """Every field ``_dependencies`` reads, as values (tuples: a later
        edit of a list or a shape in place cannot reach them): each op's
        key, name, inputs, outputs and control inputs, each blob's key,
        alias, offset and shape, in the dicts' orders. A blob alone on its
        storage (no alias, none aliasing it) gives no shape: only the
        write-after-read test of a storage's blobs reads shapes, so one
        that no shared storage holds changes no dependency (shape
        inference, after an edit, would else ask for them again: 0.75 s
        on a graph of 32 micro-batches of GPT-2 124M)."""
        blobs = self.blobs
        shared = {b.alias_of for b in blobs.values() if b.alias_of is not None}
        return (tuple((n, op.name, tuple(op.inputs), tuple(op.outputs),
                       tuple(op.control_inputs)) for n, op in self.ops.items()),
                tuple((n, b.alias_of, b.offset,
                       None if b.shape is None or (b.alias_of is None and n not in shared)
                       else tuple(b.shape))
                      for n, b in blobs.items()))

    def _dependencies(self):
        """``dependencies``, computed."""
        prod, cons = self.producers(), self.consumers()
        deps = {name: set(op.control_inputs) for name, op in self.ops.items()}
        for op in self.ops.values():
            for b in op.inputs:
                for p in prod.get(b, ()):
                    if p.name != op.name:
                        deps[op.name].add(p.name)
        # write-after-read: a writer into shared storage waits for every reader
        # of an overlapping blob on that storage, unless the reader is itself
        # downstream of the writer (it reads what the writer produced).
        # each blob's storage root and extent looked up once (a bucket's
        # writer meets every blob on the bucket: quadratic in the lookups)
        root_of = self.storage_roots()
        by_root = defaultdict(list)
        for b in self.blobs:
            by_root[root_of[b]].append(b)
        succ = defaultdict(set)
        for n, d in deps.items():
            for p in d:
                succ[p].add(n)
        # whether a reader is downstream of an alias writer: one sweep over
        # the data and control edges in a topological order gives each op
        # the set of alias writers upstream of it, as bits (a search from
        # each writer instead costs writers x ops: quadratic in the
        # micro-batches, whose running sums each write a view); with a
        # cycle or an unknown control input, a search per writer
        writers = [op.name for op in self.ops.values()
                   if any(self.blobs[out].alias_of is not None for out in op.outputs)]
        upstream = _upstream_bits(deps, writers) if writers else None
        war = defaultdict(set)
        extent = {}
        readable = {}   # root -> its blobs that some op reads, as arrays of extents
        for op in self.ops.values():
            downstream = None
            for out in op.outputs:
                if self.blobs[out].alias_of is None:
                    continue
                for other in self._overlapping_read(out, root_of[out], by_root, cons,
                                                    extent, readable):
                    if other == out:
                        continue
                    for reader in cons[other]:
                        if reader.name == op.name:
                            continue
                        if upstream is not None:
                            if not upstream[1][reader.name] >> upstream[0][op.name] & 1:
                                war[op.name].add(reader.name)
                            continue
                        if downstream is None:
                            downstream = reachable(op.name, succ)
                        if reader.name not in downstream:
                            war[op.name].add(reader.name)
        for n, extra in war.items():
            deps[n] |= extra
        return deps

    def _overlapping_read(self, name, root, by_root, cons, extent, readable):
        """The blobs on storage ``root`` that some op reads (``cons``) and
        whose elements may meet ``name``'s (``_overlap`` not False: an
        unknown shape meets everything), in ``by_root``'s order: one
        vectorised interval test per writer, not a test per blob pair
        (a gradient bucket holds every micro-batch's view of it).
        ``readable`` keeps each root's (names, starts, ends, unknown)."""
        got = readable.get(root)
        if got is None:
            names = [b for b in by_root[root] if b in cons]
            ext = [self._extent(b, extent) for b in names]
            starts = np.array([0 if e is None else e[0] for e in ext], dtype=np.int64)
            ends = np.array([0 if e is None else e[0] + e[1] for e in ext], dtype=np.int64)
            unknown = np.array([e is None for e in ext], dtype=bool)
            got = readable[root] = (names, starts, ends, unknown)
        names, starts, ends, unknown = got
        mine = self._extent(name, extent)
        if mine is None:
            return names
        if len(names) < 16:
            return [n for n, a, b, u in zip(names, starts.tolist(), ends.tolist(),
                                            unknown.tolist())
                    if u or (a < mine[0] + mine[1] and mine[0] < b)]
        hit = unknown | ((starts < mine[0] + mine[1]) & (mine[0] < ends))
        return [names[i] for i in np.flatnonzero(hit).tolist()]

    def _overlap(self, a, b, extent=None):
        """Whether blobs ``a`` and ``b`` share elements of their storage
        (None: a shape is unknown); ``extent``: a dict that keeps each
        blob's (offset, size) between calls on an unchanged graph."""
        ea, eb = self._extent(a, extent), self._extent(b, extent)
        if ea is None or eb is None:
            return None
        return ea[0] < eb[0] + eb[1] and eb[0] < ea[0] + ea[1]

    def _extent(self, name, memo=None):
        if memo is not None and name in memo:
            return memo[name]
        blob = self.blobs[name]
        ext = None if blob.shape is None else (self._abs_offset(name), blob.size)
        if memo is not None:
            memo[name] = ext
        return ext

    def _abs_offset(self, name):
        off = 0
        while self.blobs[name].alias_of is not None:
            off += self.blobs[name].offset
            name = self.blobs[name].alias_of
        return off

    def topo_order(self, deps=None):
        """Ops in a dependency-respecting order (emission order breaks ties).
        Raises GraphError naming the ops on a cycle. The order is kept
        beside the graph and given again while the op names (in their
        order) and the dependencies are what it was computed from: passes
        ask for the order of an unchanged graph many times, and Kahn's sort
        of a graph of 32 micro-batches costs ~0.2 s."""
        if not deps:
            deps = self._dependency_answer()
        names = tuple(self.ops)
        last = _LAST_ORDER.get(self)
        if last is not None and last[0] == names and (last[1] is deps or last[1] == deps):
            return [self.ops[n] for n in last[2]]
        answer = _LAST_DEPENDENCIES.get(self, (None, None, None))
        shared = deps is answer[1]
        if shared and answer[2][0] is not None and answer[2][0][0] == names:
            # the order of this content's answer, sorted for another graph
            # of the content (another rank's composition): the same op
            # names in the same order, the same dependencies, so the same
            # order (Kahn's sort of the ops of 32 micro-batches: ~0.12 s)
            order = [self.ops[n] for n in answer[2][0][1]]
        else:
            order = _kahn(self.ops, deps)
        kept = deps if shared else {n: frozenset(d) for n, d in deps.items()}
        _LAST_ORDER[self] = (names, kept, [op.name for op in order])
        if shared:
            answer[2][0] = (names, _LAST_ORDER[self][2])
        return order

    # ---------------------------------------------------------- validation
    def validate(self, registry=None):
        """Check op types, dangling inputs, double writers and cycles."""
        from ..ops.catalog import get_kernel_class
        prod = self.producers()
        for op in self.ops.values():
            get_kernel_class(op.op_type, op.name)  # raises for an unknown type
        for b, writers in prod.items():
            if len(writers) > 1 and not all(w.accumulate for w in writers):
                raise GraphError(
                    f"blob '{b}' is written by {len(writers)} ops "
                    f"({', '.join(w.name for w in writers)}) that do not declare accumulate: true")
        for op in self.ops.values():
            for b in op.inputs:
                blob = self.blobs[b]
                if b not in prod and blob.shape is None and blob.alias_of is None:
                    raise GraphError(
                        f"op '{op.name}' reads blob '{b}', which no op produces and "
                        "which has no declared size (a dangling input)")
        self.topo_order()
        return self

    def infer_shapes(self, ops=None):
        """Fill in blob shapes from source blobs through every kernel's
        ``infer``; a declared shape that disagrees is a ShapeError.
        ``ops``: only these (a part of the graph whose other ops' outputs
        have their shapes already: ``layers/build.NetBuilder.shape``), each
        after those of them that write its inputs."""
        from ..ops.catalog import get_kernel_class
        for op in (self.topo_order() if ops is None else _writers_first(ops)):
            ins = []
            for b in op.inputs:
                blob = self.blobs[b]
                if blob.shape is None:
                    raise ShapeError(f"op '{op.name}' ({op.op_type}): input blob '{b}' has no "
                                     "known shape (no producer and no size)", op=op.name)
                ins.append((blob.shape, blob.dtype))
            cls = get_kernel_class(op.op_type, op.name)
            try:
                outs = cls.infer(op.attrs, ins)
            except ShapeError as e:
                raise ShapeError(f"op '{op.name}' ({op.op_type}) with inputs "
                                 f"{_fmt_ins(op, ins)}: {e}", op=op.name) from None
            except (ValueError, IndexError, KeyError, TypeError) as e:
                raise ShapeError(f"op '{op.name}' ({op.op_type}) with inputs "
                                 f"{_fmt_ins(op, ins)}: {e}", op=op.name) from None
            if len(outs) != len(op.outputs):
                raise ShapeError(f"op '{op.name}' ({op.op_type}) has {len(op.outputs)} outputs, "
                                 f"its kernel produces {len(outs)}", op=op.name)
            for b, (shape, dtype) in zip(op.outputs, outs):
                blob = self.blobs[b]
                shape = tuple(int(s) for s in shape)
                if blob.shape is not None and tuple(blob.shape) != shape:
                    raise ShapeError(f"op '{op.name}' ({op.op_type}) produces blob '{b}' of shape "
                                     f"{list(shape)}, but the blob is declared {list(blob.shape)}",
                                     op=op.name)
                blob.shape, blob.dtype = shape, _dtype_name(dtype)
        return self

    # -------------------------------------------------------------- pruning
    def prune(self, sinks):
        """Keep only the ops some sink blob (or sink op name) needs."""
        prod = self.producers()
        deps = self.dependencies()
        keep_ops, stack = set(), []
        for s in sinks:
            if s in self.ops:
                stack.append(s)
            elif s in self.blobs:
                stack.extend(o.name for o in prod.get(s, ()))
            else:
                raise GraphError(f"sink '{s}' is neither a blob nor an op of the graph")
        while stack:
            n = stack.pop()
            if n in keep_ops:
                continue
            keep_ops.add(n)
            stack.extend(deps[n] - keep_ops)
        pruned = Graph(self.name)
        for n, op in self.ops.items():
            if n in keep_ops:
                op = Op(op.name, op.op_type, list(op.inputs), list(op.outputs), dict(op.attrs),
                        op.location, op.thread, op.accumulate,
                        [c for c in op.control_inputs if c in keep_ops])
                pruned.ops[n] = op
        used = {b for op in pruned.ops.values() for b in op.inputs + op.outputs}
        used |= {s for s in sinks if s in self.blobs}
        frontier = list(used)
        while frontier:  # keep alias roots of used blobs
            b = frontier.pop()
            a = self.blobs[b].alias_of
            if a is not None and a not in used:
                used.add(a)
                frontier.append(a)
        for b, blob in self.blobs.items():
            if b in used:
                pruned.blobs[b] = blob
        return pruned

    # ---------------------------------------------------------- inspection
    def params(self):
        """Parameter blobs that own their storage (not their ``@new`` aliases),
        or are views into a flat parameter buffer (kind ``param_buffer``, laid
        out by ``parallel/fuse.py`` for a multi-tensor update)."""
        return [b for b in self.blobs.values() if b.kind == "param" and (
            b.alias_of is None or self.blobs[b.alias_of].kind == "param_buffer")]

    def summary(self):
        """Human-readable listing (``graph --format text``)."""
        lines = [f"graph {self.name}: {len(self.blobs)} blobs, {len(self.ops)} ops"]
        # the compute dtype of every op, once the precision pass marked some
        mixed = any(op_precision(op) != "float32" for op in self.ops.values())
        for op in self.topo_order():
            ins = ", ".join(op.inputs)
            outs = ", ".join(op.outputs)
            loc = f"rank {op.location.rank}" + (f" gpu {op.location.device}"
                                               if op.location.device >= 0 else "")
            dtype = f", {SHORT.get(op_precision(op), op_precision(op))}" if mixed else ""
            lines.append(f"  {op.name:<32} {op.op_type:<22} [{ins}] -> [{outs}]  "
                         f"({loc}, thread {op.thread}{dtype})")
        return "\n".join(lines)


def op_precision(op):
    """The dtype ``op`` computes in (parallel/precision.py marks it): its
    ``compute_dtype``, a Cast's target dtype, else float32."""
    if op.op_type == "Cast":
        return op.attrs.get("dtype", "float32")
    return op.attrs.get("compute_dtype", "float32")


def ancestor_bits(order, deps):
    """Each op's ancestors as a bit set over its position in ``order`` (a
    topological order of the op names; ``deps``: {op: its direct
    predecessors}, ``Graph.dependencies``): ({op: position}, {op: bits})."""
    pos = {n: i for i, n in enumerate(order)}
    anc = {}
    for n in order:
        a = 0
        for p in deps[n]:
            a |= anc[p] | (1 << pos[p])
        anc[n] = a
    return pos, anc


def _writers_first(ops):
    """``ops`` in an order where each comes after those of them that write
    one of its inputs or that it names as a control input (emission order
    breaks ties); for shape inference of a part of a graph."""
    names = {op.name for op in ops}
    writers = defaultdict(set)
    for op in ops:
        for b in op.outputs:
            writers[b].add(op.name)
    deps = {op.name: ({w for b in op.inputs for w in writers.get(b, ())} |
                      (set(op.control_inputs) & names)) - {op.name} for op in ops}
    return _kahn({op.name: op for op in ops}, deps)


def _kahn(ops, deps):
    """The ops of ``ops`` ({name: op}, in emission order) in an order where
    each comes after its predecessors ``deps`` ({name: set of names}),
    emission order breaking ties (Kahn's algorithm; ``Graph.topo_order``
    and ``_writers_first``). Raises GraphError naming the ops on a cycle."""
    indeg = {n: len(d) for n, d in deps.items()}
    succ = defaultdict(list)
    for n, d in deps.items():
        for p in d:
            if p not in ops:
                raise GraphError(f"op '{n}' depends on unknown op '{p}'")
            succ[p].append(n)
    index = {n: i for i, n in enumerate(ops)}
    ready = [(index[n], n) for n, k in indeg.items() if k == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(ops[n])
        for s in succ[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, (index[s], s))
    if len(order) != len(ops):
        # ops downstream of a cycle are stuck too: peel off those with no
        # stuck successor so the message names the cycle, not its fallout
        stuck = {n for n, k in indeg.items() if k > 0}
        leaves = [n for n in stuck if not any(s in stuck for s in succ[n])]
        while leaves:
            n = leaves.pop()
            stuck.discard(n)
            leaves.extend(p for p in deps[n] if p in stuck and p not in leaves
                          and not any(s in stuck for s in succ[p]))
        raise GraphError("the graph has a cycle through ops: " +
                         ", ".join(sorted(stuck)[:10]))
    return order


def _upstream_bits(deps, sources):
    """({source: bit index}, {op: bits of the ``sources`` it is downstream
    of}) over ``deps`` ({op: its predecessors}): op n's bit set has source
    s's bit exactly when n is in ``reachable(s, successors)``; None where
    ``deps`` has a cycle or names an op it has no entry for (there is no
    topological order to sweep in)."""
    indeg = {}
    succ = defaultdict(list)
    for n, d in deps.items():
        indeg[n] = len(d)
        for p in d:
            if p not in deps:
                return None
            succ[p].append(n)
    order = [n for n, k in indeg.items() if k == 0]
    for n in order:  # grows as it goes: Kahn's algorithm, any order will do
        for s in succ[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                order.append(s)
    if len(order) != len(deps):
        return None
    bit = {s: i for i, s in enumerate(sources)}
    mine = {s: 1 << i for s, i in bit.items()}
    up = {}
    for n in order:
        b = 0
        for p in deps[n]:
            b |= up[p] | mine.get(p, 0)
        up[n] = b
    return bit, up


def reachable(start, succ):
    """The names reachable from ``start`` through ``succ`` ({name: [next
    names]}), transitively, ``start`` itself only through a cycle: the
    successors with an op's consumers, its ancestors with its dependencies."""
    seen, stack = set(), [start]
    while stack:
        for s in succ[stack.pop()]:
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return seen


def _fmt_ins(op, ins):
    return ", ".join(f"'{b}' {list(s)}" for b, (s, _) in zip(op.inputs, ins))
