"""The precision pass: which ops of a placed graph compute in bfloat16 or
float16 (config key ``precision``; docs/gpu.md, "Precision").

``apply_precision(graph, precision)`` rewrites a composed, placed graph in
place, op by op, after PyTorch autocast's lists:

- the GEMMs (``InnerProduct`` and its data and weight gradients), the
  convolutions (``Conv``, ``ConvGradData``, ``ConvGradWeight``) and the
  attention products (``Attention``, ``AttentionScores``,
  ``AttentionContext`` and their gradients) get ``compute_dtype``
  ``bfloat16`` (``float16``): their float32 inputs are replaced by rounded
  copies ``<blob>@bf16`` (``@fp16``) written by a ``Cast`` op (one per blob,
  shared by its readers; where the Cast is the last op to touch a
  transient blob the memory plan puts the copy on the blob's bytes:
  ``Cast.in_place``), they accumulate in float32 and round their outputs
  (ops/registry.py's ``make_kernel``);
- everything else stays float32: softmax, layer norm, the loss, the
  reductions (a bias gradient, the gradient sums), the element-wise ops,
  the gradient allreduce and the optimizer update.

The master weights stay float32 (a checkpoint holds them: a bf16 run
resumes in fp32 and back). A weight read by a low-precision op gets its
copy ``<w>@bf16``, cast once per iteration before the forward -- that is,
after the previous iteration's update -- and read by the forward GEMM and
by its data gradient: a copy rather than a rounding on every read. Being
made from the masters each iteration, the copy is no state of its own
(nothing to checkpoint, nothing stale after ``--init``).

The storage stays float32 -- the copies and outputs hold bfloat16 (float16)
values, the numbers a GPU's bf16 GEMM with float32 accumulation gives --
but for bf16 storage (``store_bits``): a bfloat16 blob whose producer can
write it as bits (``OpKernel.bits_outputs``: a Cast, a bf16 product -- the
fc data gradient's dx too --, the attention's ctx and its gradient's
dqkv) and whose every reader takes it as bits
(``OpKernel.bits_inputs``: the fully connected products' operands, GELU's
and its gradient's x, the fused attention's and its gradient's qkv, an
Eltwise sum's terms, the dy of GELU's, the layer norm's and the fc bias's
gradients, the attention gradient's dctx) is
stored as the uint16 bits of its values (base/precision.BITS, 2 bytes an
element) and written so (the producer's attr ``bits_out``): its readers
widen it where they read it or take it as it is (GemmEx, cuDNN's SDPA),
the memory plan sizes it at 2 bytes, and no float32 copy of it exists.
Where such a copy's Cast is the only reader of a transient float32 blob
whose producer can write bits itself (LayerNorm's y, GELU's y), the
producer writes the bits and the Cast and the float32 blob go
(``fold_casts``). Where the source has float32 readers too and its
producer can write the bits as a second output (``OpKernel.bits_copies``:
GELU's gradient, a gradient ``Sum``, a layer norm's gradient's dx, a
redrawn dropout's gradient), it does, in the same pass, and the Cast goes
(``fold_copies``): the float32 blob stays for those readers.
A bf16 product (no fused ReLU) writes its output as bits
too: without a bias its GemmEx's bfloat16 result; with one its GemmEx's
float32 result into scratch, to which one kernel adds the bias before the
one rounding (ops/fc.py). In GPT-2: the MLP's fc output (read by GELU and
its gradient), qkv (read by the fused attention and its gradient), the
projections' outputs (read by the residual adds) and the lm-head's
logits, where the softmax loss reads them ``from_logits``
(``loss_from_logits``: no probabilities kept, its gradient computes them
again from the logits, a chunk at a time, and writes its own copy as
bits). The data gradients of bf16 values too: the fc data gradients
(GemmEx's bfloat16 result, as the bias-free forward) read by GELU's,
the layer norms' and the attention's gradients, and the attention's dqkv
(cuDNN's SDPA writes it as bfloat16) read by qkv's data, weight and bias
gradients -- activation gradients only: a gradient of float32 values
(GELU's or a layer norm's dx, a residual ``Sum``) is no bf16 blob, a
parameter gradient (read by the allreduce, clipping and the update, which
take no bits) stays float32, and an accumulated blob (a micro-batch's
running sum, a Sum in place) is never stored as bits (``_bits_writer``).
The same numbers: the bits are the upper halves of the float32 roundings.
``PURINE_BF16_STORAGE=0`` (or ``PURINE_BF16_GEMM=0``, whose products take
float32 operands) keeps the float32 storage.

A fused ``Attention`` op in bf16/fp16 and its gradient are marked ``sdpa``
(``keep_attention_stats``): on a GPU they run cuDNN's fused attention
where it takes the shape (gpu/sdpa.py), the forward keeping the softmax
statistics as a second output for the backward.

Each op records its dtype in ``attrs["compute_dtype"]`` and each blob
holding low-precision values in ``attrs["precision"]``; ``dtype_table``
lists them (the ``graph`` command shows them).
"""
from ..base.precision import BITS, SHORT, low_dtype
from ..graph.core import PERSISTENT_KINDS
from ..graph.core import op_precision as op_dtype
from .fuse import _wait_for

#: op types that compute in the low precision (autocast's lower-precision list)
LOW_OP_TYPES = ("InnerProduct", "InnerProductGradData", "InnerProductGradWeight",
                "Conv", "ConvGradData", "ConvGradWeight",
                "Attention", "AttentionGrad", "AttentionScores", "AttentionScoresGrad",
                "AttentionContext", "AttentionContextGrad")
#: inputs (by op type) that are not operands of the product: left as they are
#: (a fused ReLU's mask: a float16 rounding could zero a tiny positive value)
_NOT_OPERANDS = {"ConvGradData": slice(2, None)}
#: the op type of the copies
CAST = "Cast"


def apply_precision(graph, precision):
    """Mark and rewrite ``graph`` for ``precision`` (see the module
    docstring); fp32 and tf32 leave it unchanged. Returns the names of the
    ops marked low-precision."""
    dtype = low_dtype(precision)
    if dtype is None:
        return []
    suffix = "@" + SHORT[dtype]
    twins, marked = {}, []
    for name in list(graph.ops):
        op = graph.ops[name]
        if op.op_type not in LOW_OP_TYPES:
            continue
        op.attrs["compute_dtype"] = dtype
        marked.append(name)
        skip = range(len(op.inputs))[_NOT_OPERANDS.get(op.op_type, slice(0, 0))]
        for i, b in enumerate(op.inputs):
            blob = graph.blobs[b]
            if i in skip or blob.dtype != "float32" or blob.attrs.get("precision") == dtype:
                continue
            op.inputs[i] = _twin(graph, twins, b, dtype, suffix, op)
        if not op.accumulate:
            for b in op.outputs:
                if graph.blobs[b].dtype == "float32":
                    graph.blobs[b].attrs["precision"] = dtype
    keep_attention_stats(graph)
    if dtype == "bfloat16" and bits_storage():
        loss_from_logits(graph)
    if dtype == "bfloat16" and store_bits(graph):
        fold_casts(graph)
        fold_copies(graph)
    graph.infer_shapes()
    return marked


def bits_storage():
    """Whether bf16 blobs may be stored as bits (``store_bits``):
    ``PURINE_BF16_STORAGE`` and ``PURINE_BF16_GEMM`` on (the defaults)."""
    from ..base import env
    return bool(env.get("PURINE_BF16_STORAGE")) and bool(env.get("PURINE_BF16_GEMM"))


def store_bits(graph):
    """Store as bfloat16 bits each blob of bfloat16 values (attr
    ``precision``, float32 storage, no views) that has one producer, which
    can write it as bits (``bits_outputs``), and readers, every one taking
    it as bits at each input it is (``bits_inputs``), all on the producer's
    device: the blob's dtype becomes ``BITS`` and its index goes into the
    producer's attr ``bits_out``. Where a reader cannot take bits, nothing
    changes. Nor where the producer is a Cast of a transient float32 blob
    read by nothing else (the memory plan puts such a float32 copy on its
    source's bytes: 4 bytes an element, where bits of their own would live
    beside the source at the Cast: 6) whose own producer cannot write bits
    (``fold_casts`` would remove it): the logits' gradient, for one. Off
    with ``bits_storage()`` false. Returns the names of the blobs so stored.
    Call ``graph.infer_shapes()`` after."""
    if not bits_storage():
        return []
    from ..ops.catalog import get_kernel_class
    prod, cons = graph.producers(), graph.consumers()
    viewed = {b.alias_of for b in graph.blobs.values() if b.alias_of}
    stored = []
    for name, blob in graph.blobs.items():
        if blob.attrs.get("precision") != "bfloat16" or blob.dtype != "float32" \
                or name in viewed or blob.alias_of:
            continue
        readers = cons.get(name, ())
        w = _bits_writer(graph, name, prod)
        if w is None or not readers:
            continue
        out = w.outputs.index(name)
        if not all(_takes_bits(r, name, get_kernel_class(r.op_type, r.name), w.location)
                   for r in readers):
            continue
        if w.op_type == CAST and _dies_at(graph, w, prod, cons, viewed) and \
                _bits_writer(graph, w.inputs[0], prod, w.location) is None:
            continue   # an in-place float32 copy (Cast.in_place) takes less memory
        w.attrs["bits_out"] = sorted(set(w.attrs.get("bits_out", [])) | {out})
        blob.dtype = BITS
        stored.append(name)
    return stored


def loss_from_logits(graph):
    """Make each ``SoftmaxLoss`` whose logits a product can write as bits
    read them so (ops/softmax.py, ``from_logits``): where the logits are a
    transient bfloat16 blob of float32 storage (attr ``precision``, no
    views) written by one op that can write them as bits
    (``_bits_writer``: the lm-head's product), every other
    reader of them takes bits, and the loss's ``prob`` output is read by
    ``SoftmaxLossGrad`` ops (as their probabilities) alone, all on the
    writer's device, each of which can write its gradient as bits
    (``_grad_as_bits``: a bf16 copy of it that products alone read): the
    loss gets attr ``from_logits`` and loses its ``prob`` output (the blob
    goes), and each of those gradients reads the logits in its place (attr
    ``from_logits``), computing the probabilities again, after the loss (a
    control input: the memory plan may then put its gradient on the
    logits' bytes). ``store_bits`` then stores the logits as bits and the
    gradient's copy as bits, which ``fold_casts`` has the gradient write
    itself. Returns the names of the losses so marked. Call
    ``graph.infer_shapes()`` after."""
    from ..ops.catalog import get_kernel_class
    prod, cons = graph.producers(), graph.consumers()
    viewed = {b.alias_of for b in graph.blobs.values() if b.alias_of}
    marked = []
    for op in list(graph.ops.values()):
        if op.op_type != "SoftmaxLoss" or op.attrs.get("from_logits") or len(op.outputs) != 2:
            continue
        x, prob = op.inputs[0], op.outputs[1]
        blob = graph.blobs[x]
        if blob.attrs.get("precision") != "bfloat16" or blob.dtype != "float32" or \
                x in viewed or blob.alias_of or blob.kind in PERSISTENT_KINDS:
            continue
        w = _bits_writer(graph, x, prod, op.location)
        grads = cons.get(prob, ())
        if w is None or prob in viewed or graph.blobs[prob].alias_of or len(
                prod.get(prob, ())) != 1 or not all(
                g.op_type == "SoftmaxLossGrad" and g.inputs[1] == prob and
                g.inputs.count(prob) == 1 and g.location == op.location and
                x not in g.inputs for g in grads):
            continue
        if not all(r is op or _takes_bits(r, x, get_kernel_class(r.op_type, r.name), w.location)
                   for r in cons.get(x, ())) or \
                not all(_grad_as_bits(graph, g, cons, viewed) for g in grads):
            continue
        op.attrs["from_logits"] = True
        op.outputs.pop(1)
        del graph.blobs[prob]
        for g in grads:   # after the loss, which read the logits (dx may take their bytes)
            g.inputs[1] = x
            g.attrs["from_logits"] = True
            if op.name not in g.control_inputs:
                g.control_inputs.append(op.name)
        marked.append(op.name)
    return marked


def _grad_as_bits(graph, grad, cons, viewed):
    """Whether ``store_bits`` and ``fold_casts`` will have the loss
    gradient ``grad`` (from its logits) write its output as bits: the
    output is a transient float32 blob (no views, not accumulated) that one
    bfloat16 Cast alone reads, on ``grad``'s device, whose copy only ops
    taking bits read (the lm-head's products; not a weight gradient of
    rows). Else its float32 output could not take the logits' 2-byte bytes
    in place, and reading the logits as bits would cost memory."""
    (dx,) = grad.outputs
    readers = cons.get(dx, ())
    if grad.accumulate or len(readers) != 1 or readers[0].op_type != CAST or \
            readers[0].attrs.get("dtype") != "bfloat16" or \
            not _dies_at(graph, readers[0], None, cons, viewed) or \
            readers[0].location != grad.location:
        return False
    from ..ops.catalog import get_kernel_class
    copy = readers[0].outputs[0]
    return bool(cons.get(copy)) and all(
        _takes_bits(r, copy, get_kernel_class(r.op_type, r.name), grad.location)
        for r in cons[copy])


def fold_casts(graph):
    """Fold each Cast that writes bits (``bits_out``, from ``store_bits``)
    into the producer of its source where the source is a transient float32
    blob (``_dies_at``: no views, not a loss or metric) that the Cast alone
    reads, written by one op on the Cast's device that can write that
    output as bits (``bits_outputs``): the producer writes the Cast's output
    as bits (its attr ``bits_out``), the Cast and the float32 blob are
    removed (an op that waited for the Cast waits for the producer). The
    float32 blob never exists. Returns the names of the Casts folded. Call
    ``graph.infer_shapes()`` after."""
    prod, cons = graph.producers(), graph.consumers()
    viewed = {b.alias_of for b in graph.blobs.values() if b.alias_of}
    folded = []
    for cast in list(graph.ops.values()):
        if cast.op_type != CAST or 0 not in cast.attrs.get("bits_out", ()) \
                or cast.control_inputs or not _dies_at(graph, cast, prod, cons, viewed):
            continue
        src = cast.inputs[0]
        w = _bits_writer(graph, src, prod, cast.location)
        if w is None:
            continue
        out = w.outputs.index(src)
        w.outputs[out] = cast.outputs[0]
        w.attrs["bits_out"] = sorted(set(w.attrs.get("bits_out", [])) | {out})
        graph.remove_op(cast.name)
        del graph.blobs[src]
        _wait_for(graph, {cast.name}, w.name)
        folded.append(cast.name)
    return folded


def fold_copies(graph):
    """Fold each Cast that writes bits (``bits_out``) of a transient float32
    blob that other ops read too (a float32 reader that needs its float32
    values: a bias gradient summing them) into the blob's producer, where
    that is one op on the Cast's device, not accumulating, that can write
    the bits of that output as well (``bits_copies``): the producer gets the
    Cast's output as an extra output, after its own (listed in its attr
    ``bits_out``), and the copied output's index in its attr
    ``bits_copy``; the Cast goes (an op that waited for
    it waits for the producer). The float32 blob stays for its other
    readers; the bits are those the Cast wrote, written in the producer's
    pass (GeluGrad's dx read by the fc bias gradient and, as bits, by the
    fc's data and weight gradients; a residual gradient's Sum; ln_f's
    LayerNormGrad's dx; a residual dropout's DropoutRedrawGrad). A float32
    reader emitted after the
    first reader of the bits that would be ready as early (the bias
    gradient, emitted after the fc's data and weight gradients) moves
    before it in the emission order (``_float32_readers_first``), so the
    float32 blob is not held across the products that read the bits (with
    the Cast, which they waited for, the schedule ran it first). Run after
    ``fold_casts``. Returns the names of the Casts folded. Call
    ``graph.infer_shapes()`` after."""
    prod = graph.producers()
    viewed = {b.alias_of for b in graph.blobs.values() if b.alias_of}
    folded, pairs = [], []
    for cast in list(graph.ops.values()):
        if cast.op_type != CAST or 0 not in cast.attrs.get("bits_out", ()) \
                or cast.control_inputs:
            continue
        src = cast.inputs[0]
        if not _transient_float32(graph, src, viewed):
            continue
        w = _bits_writer(graph, src, prod, cast.location,
                         can=lambda cls, op: cls.bits_copies(op.attrs))
        if w is None:
            continue
        out = w.outputs.index(src)
        copies = list(w.attrs.get("bits_copy", ()))
        if out in copies:
            continue
        w.attrs["bits_copy"] = copies + [out]
        w.outputs.append(cast.outputs[0])
        w.attrs["bits_out"] = sorted(set(w.attrs.get("bits_out", [])) |
                                     {len(w.outputs) - 1})
        graph.remove_op(cast.name)
        _wait_for(graph, {cast.name}, w.name)
        folded.append(cast.name)
        pairs.append((src, cast.outputs[0]))
    _float32_readers_first(graph, pairs)
    return folded


def _float32_readers_first(graph, pairs):
    """For each (float32 blob, its bits copy) of ``pairs``: move the compute
    ops reading the float32 blob that do not read the copy, are emitted
    after the copy's first reader and would be ready as early (each op
    writing one of their inputs, and each of their control inputs, emitted
    before that reader) to just before it in the emission order
    (``graph.ops``), which breaks the ties of the schedule
    (``Graph.topo_order``; the memory plan's): they then run before the
    copy's readers, and the float32 blob's lifetime ends there, not after
    them. A comm op (a pipeline's send of the gradient) stays where it is."""
    from ..ops.catalog import get_kernel_class
    prod, cons = graph.producers(), graph.consumers()   # the same in any order
    for src, copy in pairs:
        names = list(graph.ops)
        pos = {n: i for i, n in enumerate(names)}
        firsts = [pos[op.name] for op in cons.get(copy, ())]
        if not firsts:
            continue
        first = min(firsts)
        move = [n for n in names[first + 1:]
                if src in graph.ops[n].inputs and copy not in graph.ops[n].inputs and
                get_kernel_class(graph.ops[n].op_type, n).category != "comm" and
                all(pos[w.name] < first for b in graph.ops[n].inputs for w in prod.get(b, ()))
                and all(pos.get(c, -1) < first for c in graph.ops[n].control_inputs)]
        if not move:
            continue
        moved = set(move)
        order = [n for n in names[:first] if n not in moved] + move + \
            [n for n in names[first:] if n not in moved]
        graph.ops = {n: graph.ops[n] for n in order}


def _dies_at(graph, cast, prod, cons, viewed):
    """Whether ``cast``'s source is a transient float32 blob (no kind kept
    across iterations, no views, not a loss or a metric) that ``cast``
    alone reads."""
    src = cast.inputs[0]
    return [r.name for r in cons.get(src, ())] == [cast.name] and \
        _transient_float32(graph, src, viewed)


def _transient_float32(graph, name, viewed):
    """Whether blob ``name`` is a transient float32 blob: no kind kept
    across iterations, no views (``viewed``: the blobs with views), not a
    loss or a metric."""
    blob = graph.blobs[name]
    return blob.kind not in PERSISTENT_KINDS \
        and not blob.alias_of and name not in viewed and blob.dtype == "float32" \
        and "loss_weight" not in blob.attrs and not blob.attrs.get("metric")


def _bits_writer(graph, name, prod, location=None, can=None):
    """The one op writing blob ``name`` (on ``location``, where given) that
    can write it as bits (``bits_outputs``; ``can(cls, op)``: the indices of
    the outputs it can, where given: ``fold_copies``' ``bits_copies``; not
    accumulating, not in place), or None."""
    from ..ops.catalog import get_kernel_class
    writers = prod.get(name, ())
    if len(writers) != 1:
        return None
    w = writers[0]
    cls = get_kernel_class(w.op_type, w.name)
    able = cls.bits_outputs_of(w) if can is None else can(cls, w)
    if w.accumulate or name in w.inputs or location not in (None, w.location) or \
            w.outputs.index(name) not in able:
        return None
    return w


def _takes_bits(reader, name, cls, location):
    """Whether op ``reader`` (kernel class ``cls``) takes blob ``name`` as
    bits at each input it is, and lives on ``location``."""
    if reader.location != location or name in reader.outputs:
        return False
    takes = cls.bits_inputs(reader.attrs)
    return all(i in takes for i, b in enumerate(reader.inputs) if b == name)


def keep_attention_stats(graph):
    """Mark each low-precision fused ``Attention`` op and its gradient
    ``sdpa`` (gpu/sdpa.py: cuDNN's fused attention where it takes the
    shape): the forward gets a second output ``<ctx>.stats``, the softmax
    statistics ((N, H, T, 1) float32, no ``precision``: they stay float32),
    which the gradient reads with ctx (after qkv: [dctx, qkv, ctx, stats],
    the iteration last with dropout), so the memory planner keeps both live
    from the forward to the backward. Returns the names of the ops marked."""
    readers = {}
    for op in graph.ops.values():
        if op.op_type == "AttentionGrad":
            readers.setdefault(op.inputs[1], []).append(op)
    marked = []
    for op in list(graph.ops.values()):
        if op.op_type != "Attention" or op_dtype(op) == "float32" or op.attrs.get("sdpa") \
                or len(op.outputs) != 1:
            continue
        ctx = op.outputs[0]
        stats = graph.free_name(f"{ctx}.stats")
        graph.add_blob(stats, None, "float32", op.location, kind="data",
                       attrs={"stats_of": ctx})
        op.outputs.append(stats)
        op.attrs["sdpa"] = True
        marked.append(op.name)
        for grad in readers.get(op.inputs[0], []):
            # [dctx, qkv(, iter)]: ctx and stats go after qkv (the iteration,
            # with dropout, stays last)
            if grad.inputs[2:] == op.inputs[1:] and all(
                    grad.attrs.get(k, d) == op.attrs.get(k, d)
                    for k, d in (("causal", True), ("dropout", 0.0))):
                grad.inputs[2:2] = [ctx, stats]
                grad.attrs["sdpa"] = True
                marked.append(grad.name)
    return marked


def _twin(graph, twins, name, dtype, suffix, reader):
    """The rounded copy of blob ``name``, made once (by the first reader's
    stream, where that reader lives)."""
    if name in twins:
        return twins[name]
    src = graph.blobs[name]
    twin = graph.free_name(name + suffix)
    graph.add_blob(twin, src.shape, "float32", reader.location, kind="data",
                   attrs={"precision": dtype, "cast_of": name})
    graph.add_op(graph.free_name(f"{name}.cast"), CAST, [name], [twin], {"dtype": dtype},
                 location=reader.location, thread=reader.thread)
    twins[name] = twin
    return twin


#: the update ops whose kernel writes a weight's copy (cuda/adam.cu)
COPY_WRITERS = ("AdamUpdate", "AdamWUpdate", "MultiAdamUpdate")
#: the blob kind of a copy an update writes (graph/core.PERSISTENT_KINDS)
COPY_KIND = "param_copy"


def fold_enabled():
    """``PURINE_FOLD_WEIGHT_CASTS`` (default on)."""
    from ..base import env
    return bool(env.get("PURINE_FOLD_WEIGHT_CASTS"))


def fold_weight_casts(graph):
    """Fold the Cast of each weight that an Adam/AdamW update moves into
    that update (``COPY_WRITERS``, after ``fuse_updates``: one
    ``MultiAdamUpdate`` over all): the update's kernel writes the weight's
    low-precision copy ``<w>@bf16`` (``@fp16``) in the pass that writes the
    new float32 weight (cuda/adam.cu), the bits the Cast's rounding of
    that weight gave, and the Cast op goes -- one launch and one read of
    the weights per weight and iteration less (GPT-2 124M: 49 Casts).

    The copy then holds from one update to the next forward: it becomes a
    persistent blob (kind ``param_copy``, attr ``copy_of``: its weight),
    the update gets an output ``<copy>@new`` (its alias: the graph orders
    the update after every reader of the copy, as it does for the weight's
    ``@new``), attr ``copy_dtype`` (the Cast's dtype) and ``copy_bits``
    (stored as bfloat16 bits; on a MultiAdamUpdate one per copy, with
    ``copy_of``: the indices of the parameters whose copies its outputs
    after the flat buffers are). A step fp16's loss scaling skips (attr
    ``skip_if``) writes neither the weights nor their copies: both as they
    were. Before the first iteration, and after the weights are set from
    outside (fillers, ``--init``, a resume: ``Workspace.set``), the
    dispatcher makes every copy from its weight (``refresh_weight_copies``):
    the copy is no state of its own (nothing in a checkpoint).

    A Cast is kept where its weight is frozen (``lr_mult`` 0: no update
    writes it), updated by another solver (SGD, Nesterov, ...: their kernels
    write no copy), on another device than the update, or where anything
    but that one update writes the weight's storage: a ZeRO scheme's
    gathered weights (an Allgather writes them after the update of a shard;
    the Cast reads the gathered whole, as before), a parameter server's
    (a Recv writes them). Off with ``PURINE_FOLD_WEIGHT_CASTS=0``. Returns
    the names of the Casts removed. Call ``graph.infer_shapes()`` after."""
    from ..ops.updates import frozen
    if not fold_enabled():
        return []
    updated = {}   # weight -> (update op, parameter index or None)
    for op in graph.ops.values():
        if op.op_type not in COPY_WRITERS or op.accumulate or op.location.device is None \
                or op.location.device < 0:
            continue
        if op.op_type == "MultiAdamUpdate":
            for k, (p, m) in enumerate(zip(op.attrs["params"], op.attrs["lr_mults"])):
                if not frozen({"lr_mult": m}):
                    updated[p] = (op, k)
        elif not frozen(op.attrs):
            updated[op.inputs[0]] = (op, None)
    if not updated:
        return []
    prod, cons = graph.producers(), graph.consumers()
    root = graph.storage_root
    writers = {}   # storage root -> the names of the ops writing any blob on it
    for op in graph.ops.values():
        for b in op.outputs:
            writers.setdefault(root(b), set()).add(op.name)
    viewed = {b.alias_of for b in graph.blobs.values() if b.alias_of}
    folded = []
    for cast in [op for op in graph.ops.values() if op.op_type == CAST]:
        src, copy = cast.inputs[0], cast.outputs[0]
        found = updated.get(src)
        if found is None or len(cast.outputs) != 1 or cast.accumulate:
            continue
        update, k = found
        w, c = graph.blobs[src], graph.blobs[copy]
        if cast.location != update.location or writers.get(root(src)) != {update.name} \
                or c.alias_of or copy in viewed or [op.name for op in prod.get(copy, ())] \
                != [cast.name] or not cons.get(copy) or w.dtype != "float32" \
                or c.size != w.size or c.dtype not in ("float32", BITS):
            continue
        dtype = cast.attrs["dtype"]
        if update.attrs.get("copy_dtype", dtype) != dtype:
            continue
        graph.remove_op(cast.name)
        for other in graph.ops.values():   # the copy is there before the iteration
            if cast.name in other.control_inputs:
                other.control_inputs = [x for x in other.control_inputs if x != cast.name]
        c.kind = COPY_KIND
        c.attrs["copy_of"] = src
        new = graph.free_name(f"{copy}@new")
        graph.add_blob(new, c.shape, c.dtype, c.location, kind=COPY_KIND, alias_of=copy)
        update.outputs.append(new)
        update.attrs["copy_dtype"] = dtype
        if k is None:
            update.attrs["copy_bits"] = c.dtype == BITS
        else:
            update.attrs["copy_of"] = list(update.attrs.get("copy_of", [])) + [k]
            update.attrs["copy_bits"] = list(update.attrs.get("copy_bits", [])) + \
                [c.dtype == BITS]
        folded.append(cast.name)
    return folded


def weight_copies(graph):
    """[(copy, its weight, dtype)] of the copies the updates write
    (``fold_weight_casts``), in the graph's blob order."""
    return [(name, b.attrs["copy_of"], _copy_dtype(graph, name)) for name, b in
            graph.blobs.items() if b.kind == COPY_KIND and not b.alias_of]


def _copy_dtype(graph, copy):
    """The precision of ``copy`` (attr ``precision`` the pass gave it)."""
    return graph.blobs[copy].attrs.get("precision", "bfloat16")


def refresh_weight_copies(copies, ws):
    """Make each weight copy of ``copies`` (``weight_copies``: those the
    updates write, ``fold_weight_casts``) from its weight in workspace
    ``ws``, as the Cast did before the forward (ops/basic.cast_copy: the
    same kernels). On a GPU the devices are idle before (the weights'
    writers done, on whichever stream) and after (the copies written
    before the iteration's streams read them). Returns the number made."""
    from ..ops.basic import cast_copy
    devices = []
    for copy, _, _ in copies:
        device = getattr(ws[copy], "device", None)
        if hasattr(device, "synchronize") and device not in devices:
            devices.append(device)
    for device in devices:
        device.synchronize()
    for copy, src, dtype in copies:
        dst = ws[copy]
        device = getattr(dst, "device", None)
        if hasattr(device, "__enter__"):   # a GPU's array: launched on its device
            with device:
                cast_copy(ws[src], dst, dtype)
        else:
            cast_copy(ws[src], dst, dtype)
    for device in devices:
        device.synchronize()
    return len(copies)


def blob_dtype(blob):
    """The dtype of the values ``blob`` holds (its storage dtype unless the
    pass marked low-precision values)."""
    return blob.attrs.get("precision", blob.dtype)


def dtype_table(graph):
    """[(op name, op type, dtype short name)] in the graph's op order."""
    return [(op.name, op.op_type, SHORT.get(op_dtype(op), op_dtype(op)))
            for op in graph.ops.values()]
