"""The gradient builder: walk a forward graph in reverse and emit, for each op,
the backward sub-graph its registered gradient rule describes.

Gradients are single-assignment blobs. Every contribution to the gradient of
a blob ``x`` is a fresh blob; when ``x`` feeds several consumers their
contributions are summed by one ``Sum`` op into ``x.grad``, and a single
contribution is simply renamed ``x.grad``. The loss gradient is seeded by a
``Constant`` op (the loss weight).

A rule whose contribution would be an exact copy of a gradient it already
has (an ``Eltwise`` sum's input of coefficient 1: dx_i = dy) may hand over
that blob itself (``GradContext.share``) rather than emit a copy: the
contribution is then that blob, read by more ops, never renamed (it keeps
its name, ``y.grad...``) and never written again (gradients stay single-
assignment: no rule writes a blob it reads, and the passes that write a
gradient in place -- a micro-batch's running sum, clipping, loss-scale
unscaling, the buckets -- do so on parameter gradients only, which are
never shared). Where ``x`` has other contributions, the ``Sum`` reads the
shared blob as it read the copy, at the same position: the same bits.
"""
from collections import defaultdict

from ..base.errors import GraphError
from ..ops.catalog import GRADIENTS, get_kernel_class
from ..ops.updates import frozen


def grad_name(blob):
    """Canonical name of the gradient of ``blob``."""
    return f"{blob}.grad"


def op_base(op_name):
    return op_name[:-4] if op_name.endswith(".fwd") else op_name


class GradContext:
    """What a gradient rule sees: the graph, which blobs need gradients, the
    gradient of each forward output, and helpers to emit backward ops."""

    def __init__(self, graph, needs):
        self.graph = graph
        self._needs = needs
        self._contrib = defaultdict(list)
        self._final = {}
        self._op = None
        self._count = defaultdict(int)
        #: {(blob, contribution): forward op}: contributions handed over as
        #: they are (``share``), and the op whose rule shared them
        self._shared = {}

    # -- queries ----------------------------------------------------------
    def needs_grad(self, blob):
        """True when a gradient must flow into ``blob`` (it depends on a param)."""
        return blob in self._needs

    def grad_of(self, blob):
        """The total gradient blob of ``blob`` (summing contributions on first
        call), or None when no gradient reaches it."""
        if blob in self._final:
            return self._final[blob]
        contribs = self._contrib.get(blob, [])
        if not contribs:
            result = None
        elif len(contribs) == 1:
            if (blob, contribs[0]) in self._shared:   # another blob's gradient: not renamed
                result = contribs[0]
            else:
                result = self._rename(contribs[0], grad_name(blob))
        else:
            fwd = self.graph.blobs[blob]
            self.graph.add_blob(grad_name(blob), fwd.shape, fwd.dtype, fwd.location, "grad")
            # placed where the first contribution's op stands; for a shared
            # one, where the op that shared it stands, and named after that
            # op's layer: a placement that follows layer names (a pipeline's
            # stages: parallel/model_parallel.place_layers) puts it where
            # the copy's writer and this Sum were before (an op of no layer
            # follows its first input's writer, here another layer's)
            sharer = self._shared.get((blob, contribs[0]))
            if sharer is None:
                where = self.graph.producers()[contribs[0]][0]
                name = f"{blob}.grad_sum"
            else:
                where = sharer
                name = f"{op_base(sharer.name)}.bwd.{blob}.grad_sum"
            self.graph.add_op(name, "Sum", contribs, [grad_name(blob)],
                              location=where.location, thread=where.thread)
            result = grad_name(blob)
        self._final[blob] = result
        return result

    # -- emission ---------------------------------------------------------
    def grad_blob(self, blob):
        """A fresh blob for one contribution to the gradient of ``blob``."""
        fwd = self.graph.blobs[blob]
        k = len(self._contrib[blob])
        name = f"{blob}.grad@{op_base(self._op.name)}" + (f"#{k}" if k else "")
        self.graph.add_blob(name, fwd.shape, fwd.dtype, self._op.location, "grad")
        self._contrib[blob].append(name)
        return name

    def share(self, blob, grad):
        """Hand over ``grad``, a final gradient blob this rule reads (a
        ``grad_of`` result), as it is, as one contribution to the gradient
        of ``blob``: no copy, no new blob (module docstring). The caller
        decides it is exact (``grad`` is the contribution, bit for bit) and
        sound (``blob`` is no parameter: see ``shareable``)."""
        if blob in self._final:
            raise GraphError(f"the gradient of '{blob}' is summed already; "
                             f"'{op_base(self._op.name)}' cannot add to it")
        self._contrib[blob].append(grad)
        self._shared[(blob, grad)] = self._op
        return grad

    def shareable(self, blob, grad):
        """Whether ``share(blob, grad)`` is sound: ``blob`` is an activation
        (kind ``data``: not a parameter, whose gradient the solver, the
        buckets, clipping and the micro-batch sums read and write by its
        name ``<param>.grad``) and ``grad`` a gradient (kind ``grad``)
        written where this op runs (its producers' location: a blob lives
        where its producer runs, parallel/partition.py), as the copy would
        have been: a pipeline stage or a model-parallel rank sends and
        receives the same blobs."""
        g = self.graph
        if g.blobs[blob].kind != "data" or g.blobs[grad].kind != "grad":
            return False
        writers = [op for op in g.ops.values() if grad in op.outputs]
        return bool(writers) and all(w.location == self._op.location for w in writers)

    def temp_blob(self, tag, shape=None, dtype="float32"):
        """An intermediate blob of this op's backward sub-graph."""
        name = f"{op_base(self._op.name)}.{tag}"
        self.graph.add_blob(name, shape, dtype, self._op.location, "data")
        return name

    def emit(self, op_type, inputs, outputs, attrs=None, tag=None):
        """Add a backward op (placed on the forward op's location and thread)."""
        base = op_base(self._op.name)
        tag = tag or _snake(op_type)
        self._count[(base, tag)] += 1
        k = self._count[(base, tag)]
        name = f"{base}.bwd.{tag}" + (f"#{k}" if k > 1 else "")
        return self.graph.add_op(name, op_type, inputs, outputs, attrs,
                                 location=self._op.location, thread=self._op.thread)

    # -- internals --------------------------------------------------------
    def _rename(self, old, new):
        g = self.graph
        blob = g.blobs.pop(old)
        blob.name = new
        g.blobs[new] = blob
        for op in g.ops.values():
            # the lists of the few ops that name it made anew (a rename per
            # gradient, each meeting every op: 6% of ``plan --choose``)
            if old in op.outputs:
                op.outputs = [new if b == old else b for b in op.outputs]
            if old in op.inputs:
                op.inputs = [new if b == old else b for b in op.inputs]
        return new


def _snake(op_type):
    out = []
    for i, c in enumerate(op_type):
        if c.isupper() and i:
            out.append("_")
        out.append(c.lower())
    return "".join(out)


def trained(blob):
    """Whether the parameter ``blob`` takes a gradient: learnable (not a
    running statistic) and not frozen (``lr_mult`` 0, ops/updates.py's
    ``frozen``: its update would change nothing). A frozen parameter gets
    no gradient op, hence no bucket, collective or update op in any scheme
    (they all compose from ``build_backward``'s result), and no solver
    state; the data gradients through its layer stay where a layer below
    needs them."""
    return blob.attrs.get("learnable", True) and not frozen(blob.attrs)


def differentiable_closure(graph, order):
    """Blobs that depend on a trained parameter (``trained``) through
    differentiable ops."""
    needs = {b.name for b in graph.blobs.values() if b.kind == "param" and trained(b)}
    for op in order:
        if op.op_type in GRADIENTS and any(b in needs for b in op.inputs):
            needs.update(op.outputs)
    return needs


def build_backward(graph, losses, params=None):
    """Append the backward pass to ``graph`` in place.

    ``losses`` maps loss blob names to loss weights. Returns a dict from
    parameter blob name to its gradient blob name (params that no loss
    reaches, and frozen ones, ``trained``, are left out)."""
    order = graph.topo_order()
    needs = differentiable_closure(graph, order)
    ctx = GradContext(graph, needs)
    for loss, weight in losses.items():
        blob = graph.blobs[loss]
        seed = f"{loss}.grad@seed"
        graph.add_blob(seed, blob.shape, blob.dtype, blob.location, "grad")
        producer = graph.producers()[loss][0]
        graph.add_op(f"{loss}.grad_seed", "Constant", [], [seed],
                     {"value": float(weight), "shape": list(blob.shape), "dtype": blob.dtype},
                     location=producer.location, thread=producer.thread)
        ctx._contrib[loss].append(seed)
    for op in reversed(order):
        if not any(ctx.grad_of(b) for b in op.outputs):
            continue
        if not any(ctx.needs_grad(b) for b in op.inputs):
            continue
        rule = GRADIENTS.get(op.op_type)
        if rule is None:
            get_kernel_class(op.op_type, op.name)
            raise GraphError(f"op '{op.name}' ({op.op_type}) lies between a parameter and the "
                             "loss but its op type has no gradient rule")
        ctx._op = op
        rule(ctx, op)
    params = params if params is not None else [b.name for b in graph.params()]
    result = {}
    for p in params:
        g = ctx.grad_of(p)
        if g is not None:
            result[p] = g
    return result
