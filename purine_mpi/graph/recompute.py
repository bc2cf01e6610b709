"""Activation recompute as a graph pass (the config's ``recompute`` and
``recompute_layers``): activations of the chosen layers are not kept from
the forward to the backward; a copy of the forward ops that made them runs
again just before the backward that reads them, as Megatron-LM's full and
selective recompute and PyTorch's ``checkpoint`` do.

``add_recompute(graph, setting, layers, patterns)`` rewrites a training graph
(forward and backward, from ``graph/grad.py``) in place, before any
parallel composition (job/replica.py calls it):

``full``
    The matched layers are cut into *units*. In a net with residual adds
    (``eltwise`` layers of two or more bottoms) a unit is a run of
    consecutive matched layers up to and including the next residual add
    (a transformer's attention half-block ``ln_1, attn, add``, then its MLP
    half ``ln_2, fc, gelu, proj, dropout, add``); in any other net each
    matched layer is a unit of its own. A unit keeps its inputs (the blobs
    it reads from outside: the residual stream, the weights); every blob it
    makes that its backward reads is recomputed, but for its outputs (the
    blobs it hands to forward ops outside it) where the unit ends at a
    residual add: the residual stream is the next unit's input, kept
    anyway, and recomputing it would copy the whole unit for a reader (the
    next LayerNorm's backward) that runs before the unit's own backward.
    A unit that ``recompute_layers`` cuts before its add (``h*_gelu``,
    ``h*_ln1``: a layer alone) recomputes its outputs too: GELU's output
    for the projection's weight gradient, from the fc output GELU's
    gradient keeps; a layer norm's rows for the next product's weight
    gradient, from the residual stream its gradient keeps.

    A unit whose copies would hold at least the bytes it drops is left as
    it is (the summary's ``no_gain``: [unit, bytes held, bytes dropped]):
    held, the blobs from outside it the copies read that nothing of the
    backward reads otherwise (their lifetimes would run on from the forward
    to the copies); dropped, the blobs recomputed and 31/32 of the masks
    packed. In a net without residual adds (one layer a unit) that leaves
    a ReLU (its copy would keep the conv output beside the ReLU output the
    next layer keeps anyway, and the ReLU would no longer run in place)
    and a max pool after a conv (its copy would keep the conv output to
    drop a quarter of it, the mask); before, ``full`` grew cifar10_quick's
    arena from 22.4 to 26.1 MiB.

``selective``
    Only attention's (N, H, T, T) tensors are recomputed: the ``Softmax``
    output after ``AttentionScores`` and the ``Dropout`` of it (with
    ``attn_dropout``), from the ``qkv`` blob the backward keeps anyway: the
    raw sub-graph (``fused: false``). The fused ``Attention`` op keeps no
    such tensor, with dropout or without (its gradient unpacks the
    forward's bit-packed mask on the host, redraws it on a GPU): nothing
    to do there.

For a unit, the backward ops that read a recomputed blob are redirected to
its copy (``<blob>@recompute``), written by a copy of its producer
(``<op>@recompute``); the copies read the originals where those stay
saved. Each copy that reads no other copy waits (control edges) for the
backward ops that feed the unit's backward from outside it, so it runs
just before that backward, once the gradient reaches the unit; the copies
take their place in the emission order just before the first op that
reads them. The original activations' lifetimes then end in the forward,
and the memory planner (runtime/memory_plan.py) sees the copies live only
during the unit's backward.

A fused ``Attention`` op with ``attn_dropout`` writes its keep-mask
bit-packed on the host (ops/attention.py, ``packed_mask``:
``<layer>.attn_mask.bits``, N·H·T·T/8 bytes). That blob is kept across
the boundary, not recomputed: the gradient reads the original's, the
memory plan counts it from the forward to the gradient, and the copy
reads it too (attr ``replay_mask``, [qkv, bits, iter] -> [ctx]) and
unpacks it instead of drawing Philox (one draw a layer an iteration, the
forward's; the copy writes no mask). A copy of an op that draws a
counter-based Philox stream (``counter_rng``) keeps its original's
stream (attr ``stream``, set to the original's name where absent): on a
GPU placement (parallel/placement.py, ``redraw_attention_masks``) drops
the packed mask and the copy's ``replay_mask``, and the copy and the
gradient draw the original's mask at the same iteration, bit for bit.

A ``Dropout`` of a unit whose mask the backward reads keeps that mask
bit-packed instead (ops/dropout.py, ``packed_mask``: uint8, 1 bit an
element, 1/32 of a float32 mask, a ``<mask>.bits`` blob the memory plan
counts from the forward to the backward): its ``DropoutGrad`` unpacks it,
and where the backward also reads the Dropout's output, the copy is a
``DropoutReplay`` of the packed mask. No copy draws Philox again (on the
CPU a draw costs ~50 times an unpack), and a Dropout kept only for its
mask (a transformer's residual dropout) is not copied, nor the projection
before it.

With ``parallel.micro_batches`` the micro-batch composition
(parallel/micro_batch.py) copies the rewritten graph once per micro-batch,
the recompute copies and their control edges with it: copy k's replays
read copy k's packed masks, and a copy that draws (the fused op's on a
GPU) draws ``<stream>@mb<k>``, its own original's stream; each copy
recomputes just before its own backward in the schedule.

The results are bitwise those without recompute: the copies run the same
kernels on the same bytes, and the unpacked mask is the drawn one. A unit is left as it is where a copy could not repeat its
op exactly: an op that accumulates, keeps state in its outputs,
communicates, or writes a blob that persists or views another (batch
norm's running statistics), or a unit that makes a loss or a metric (its
backward follows at once).
"""
import fnmatch
import re

from ..ops.catalog import get_kernel_class
from .core import PERSISTENT_KINDS

#: the values of the ``recompute`` key
RECOMPUTE_MODES = ("none", "full", "selective")
#: the suffix of a recomputed blob's or op's name
SUFFIX = "@recompute"
#: the suffix of a bit-packed Dropout mask's blob
PACKED = ".bits"
#: layer types that close a unit (a residual add) when given two or more bottoms
RESIDUAL_TYPES = ("eltwise",)


def matched_layers(layers, patterns):
    """The names of ``layers`` ((name, type, bottoms) in net order) that a
    pattern of ``patterns`` matches (fnmatch; None: every layer)."""
    if patterns is None:
        return [name for name, _, _ in layers]
    return [name for name, _, _ in layers if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def units_of(layers, patterns):
    """The layer units of full recompute (see the module docstring): lists
    of layer names."""
    chosen = set(matched_layers(layers, patterns))
    residual = {name for name, kind, bottoms in layers
                if kind in RESIDUAL_TYPES and len(bottoms) >= 2}
    units, run = [], []
    for name, _, _ in layers:
        if name not in chosen:
            if run:
                units.append(run)
            run = []
            continue
        run.append(name)
        if not residual or name in residual:
            units.append(run)
            run = []
    if run:
        units.append(run)
    return units


def _layer_of(op_name, names):
    """The layer an op belongs to: the longest layer name that prefixes
    ``<layer>.``; None for an op of no layer."""
    best = None
    for n in names:
        if op_name.startswith(n + ".") and (best is None or len(n) > len(best)):
            best = n
    return best


def forward_ops(graph):
    """Names of ``graph``'s forward ops: the ancestors of its losses' producers."""
    prod = graph.producers()
    deps = graph.dependencies()
    stack = [op.name for b in graph.blobs.values() if "loss_weight" in b.attrs
             for op in prod.get(b.name, ())]
    seen = set()
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(deps[n])
    return seen


def _repeatable(graph, op):
    """Whether a copy of ``op`` repeats it exactly and harmlessly."""
    cls = get_kernel_class(op.op_type, op.name)
    if op.accumulate or cls.category not in ("compute", "copy") or cls.keeps_outputs:
        return False
    if cls.needs_rng and not getattr(cls, "counter_rng", False):
        return False
    for b in op.outputs:
        blob = graph.blobs[b]
        if blob.alias_of is not None or blob.kind in PERSISTENT_KINDS or \
                "loss_weight" in blob.attrs or blob.attrs.get("metric"):
            return False
    return not any(graph.blobs[b].alias_of in op.outputs for b in graph.blobs)


def _selective_targets(graph, ops):
    """The (N, H, T, T) blobs of attention among ``ops``: Softmax outputs
    of AttentionScores, and the Dropout outputs (with masks) of those."""
    prod = graph.producers()
    targets = set()
    for op in ops:
        if op.op_type == "Softmax" and any(
                w.op_type == "AttentionScores" for w in prod.get(op.inputs[0], ())):
            targets.update(op.outputs)
    for op in ops:
        if op.op_type == "Dropout" and op.inputs[0] in targets:
            targets.update(op.outputs)
    return targets


def add_recompute(graph, setting, layers, patterns=None):
    """Rewrite ``graph`` for ``recompute: setting`` (see the module docstring).
    ``layers``: the net's (name, type, bottoms), in order; ``patterns``: the
    ``recompute_layers`` (None: every layer). Returns a summary dict: the
    setting, the units recomputed (lists of layer names), the blobs saved (the
    units' inputs that their copies read), the blobs recomputed and the
    packed dropout masks kept (the Dropout ops' instead of float ones, the
    fused Attention ops' instead of a copy's redraw)."""
    summary = {"setting": setting, "units": [], "saved": [], "recomputed": [], "packed": [],
               "no_gain": []}
    if setting == "none":
        return summary
    order = graph.topo_order()
    forward = forward_ops(graph)
    names = [name for name, _, _ in layers]
    by_layer = {}
    for op in order:
        if op.name in forward:
            layer = _layer_of(op.name, names)
            if layer is not None:
                by_layer.setdefault(layer, []).append(op)
    adds = {name for name, kind, bottoms in layers
            if kind in RESIDUAL_TYPES and len(bottoms) >= 2}
    if setting == "full":
        units = units_of(layers, patterns)
    else:
        units = [[n] for n in matched_layers(layers, patterns)]
    saved, recomputed, packed = set(), set(), set()
    for unit in units:
        ops = [op for layer in unit for op in by_layer.get(layer, ())]
        if not ops:
            continue
        # a unit up to a residual add keeps its outputs (the stream); a
        # unit that stops before one (``recompute_layers`` cut it there:
        # a transformer's GELU, its layer norms) recomputes them too
        done = _recompute_unit(graph, ops, forward, setting,
                               keep_outputs=setting == "full" and unit[-1] in adds)
        if done is not None and done[0] == "no gain":
            summary["no_gain"].append([unit, done[1], done[2]])
        elif done is not None:
            summary["units"].append(unit)
            saved.update(done[0])
            recomputed.update(done[1])
            packed.update(done[2])
    summary["saved"] = sorted(saved)
    summary["recomputed"] = sorted(recomputed)
    summary["packed"] = sorted(packed)
    if summary["units"]:
        graph.infer_shapes().validate()
    graph.recompute = summary
    return summary


def _packable(op, backward_readers, redo):
    """Whether ``op`` is a training Dropout whose mask the backward reads
    (and only ``DropoutGrad`` reads it): its mask is kept bit-packed."""
    if op.op_type != "Dropout" or len(op.outputs) != 2 or op.attrs.get("packed_mask"):
        return False
    mask = op.outputs[1]
    return mask in redo and all(c.op_type == "DropoutGrad" and c.inputs[1] == mask
                                and mask not in c.inputs[:1] for c in backward_readers[mask])


def _recompute_unit(graph, ops, forward, setting, keep_outputs=False):
    """Copy the ops of one unit that its backward needs; returns (blobs the
    copies read from outside, blobs recomputed, packed masks kept), or None where
    the unit is left as it is. ``keep_outputs``: the blobs the unit hands to
    forward ops outside it are kept, not recomputed (a residual net's
    stream: the next unit keeps it as its input, or its backward reads it
    before this unit's backward begins)."""
    cons, prod = graph.consumers(), graph.producers()
    made = {b for op in ops for b in op.outputs}
    unit_ops = {op.name for op in ops}
    backward_readers = {}
    for b in made:
        readers = [c for c in cons.get(b, ()) if c.name not in forward]
        if readers:
            backward_readers[b] = readers
    if setting == "selective":
        redo = _selective_targets(graph, ops) & set(backward_readers)
        kept = set(backward_readers) - redo
    else:
        redo, kept = set(backward_readers), set()
        if keep_outputs:
            leaving = {b for b in made if any(c.name in forward and c.name not in unit_ops
                                              for c in cons.get(b, ()))}
            redo -= leaving
            kept |= leaving & set(backward_readers)
    # the Dropout masks the backward reads are kept bit-packed, not recomputed,
    # and so are the fused Attention ops' packed masks (their copies replay them)
    packs = [op for op in ops if _packable(op, backward_readers, redo)]
    kept_bits = {op.outputs[-1] for op in ops if _attention_bits(op)} & redo
    redo -= {op.outputs[1] for op in packs} | kept_bits
    if not redo and not packs:
        return None
    # the producers to copy: ancestors of the blobs to redo within the unit,
    # through blobs that do not stay saved anyway
    copy_ops, stack = set(), list(redo)
    while stack:
        b = stack.pop()
        for w in prod.get(b, ()):
            if w.name in unit_ops and w.name not in copy_ops:
                copy_ops.add(w.name)
                stack.extend(x for x in w.inputs if x in made and x not in kept)
    clones = [op for op in ops if op.name in copy_ops]
    if any(not _repeatable(graph, op) for op in clones):
        return None
    held, dropped = _held_and_dropped(graph, ops, clones, redo, packs, kept_bits, forward,
                                      cons, prod)
    if held >= dropped:
        return "no gain", held, dropped
    packed = {op.name for op in packs}
    rename = {}
    for op in clones:
        for b in op.outputs[:1] if op.name in packed else op.outputs:
            if b not in kept_bits:
                rename[b] = graph.free_name(b + SUFFIX)
    # the backward ops that will read a copy, and what feeds them from outside
    readers = {c.name: c for b in redo for c in backward_readers[b]}
    deps = graph.dependencies()
    succ = {}
    for n, d in deps.items():
        for p in d:
            succ.setdefault(p, set()).add(n)
    below, stack = set(readers), list(readers)
    while stack:
        for s in succ.get(stack.pop(), ()):
            if s not in below:
                below.add(s)
                stack.append(s)
    triggers = sorted({p for r in readers for p in deps[r]
                       if p not in forward and p not in below})
    if redo and not triggers:
        return None
    bits_of = {op.name: _pack_mask(graph, op, backward_readers[op.outputs[1]]) for op in packs}
    inputs_read = set()
    new_ops = []
    for op in clones:
        if op.name in bits_of:  # replays the packed mask: no Philox draw
            op_type, ins = "DropoutReplay", [rename.get(op.inputs[0], op.inputs[0]),
                                             bits_of[op.name]]
            attrs = {"ratio": op.attrs.get("ratio", 0.5)}
        else:
            op_type, ins, attrs = op.op_type, [rename.get(b, b) for b in op.inputs], \
                dict(op.attrs)
            if getattr(get_kernel_class(op.op_type, op.name), "counter_rng", False):
                attrs.setdefault("stream", op.name)   # the original's mask stream
            if op.outputs[-1] in kept_bits:   # reads the original's packed mask: no draw
                ins.insert(len(ins) - 1, op.outputs[-1])   # [qkv, bits, iter]
                del attrs["packed_mask"]
                attrs["replay_mask"] = True
        inputs_read.update(b for b in ins if b not in rename.values())
        outs = [b for b in op.outputs if b in rename]
        for old in outs:
            src = graph.blobs[old]
            graph.add_blob(rename[old], src.shape, src.dtype, src.location, "data",
                           attrs={"recompute_of": old})
        roots = [] if any(b in rename for b in op.inputs) else list(triggers)
        new_ops.append(graph.add_op(graph.free_name(op.name + SUFFIX), op_type, ins,
                                    [rename[b] for b in outs], attrs,
                                    location=op.location, thread=op.thread,
                                    control_inputs=roots))
    for r in readers.values():
        r.inputs = [rename[b] if b in redo else b for b in r.inputs]
    if new_ops:
        # emission order: the copies just before the first op reading one
        first = next(n for n in graph.ops if n in readers)
        copies = {op.name for op in new_ops}
        reordered = {}
        for n, op in graph.ops.items():
            if n == first:
                reordered.update((c.name, c) for c in new_ops)
            if n not in copies:
                reordered[n] = op
        graph.ops = reordered
    saved = {b for b in inputs_read if graph.blobs[b].kind not in PERSISTENT_KINDS} - kept_bits
    return saved, redo, set(bits_of.values()) | kept_bits


def _held_and_dropped(graph, ops, clones, redo, packs, kept_bits, forward, cons, prod):
    """(bytes the copies of a unit would hold, bytes the unit would stop
    keeping): the blobs from outside the unit the copies read that nothing
    of the backward reads already (their lifetimes would run on from the
    forward to the copies: a CNN's pre-activation under its ReLU, the conv
    output under a max pool that keeps only its mask), and the blobs
    recomputed plus the float masks packed. A unit that would hold as many
    bytes as it drops is left as it is (a chain net's one-layer unit: the
    next layer keeps its input anyway)."""
    unit_made = {b for op in ops for b in op.outputs}

    def kept_anyway(b):
        blob = graph.blobs[b]
        if blob.kind in PERSISTENT_KINDS or b in kept_bits or not prod.get(b) or \
                all(w.op_type == "DataReader" for w in prod[b]):
            return True
        return any(c.name not in forward for c in cons.get(b, ()))
    outside = {b for op in clones for b in op.inputs if b not in unit_made}
    held = sum(graph.blobs[b].nbytes for b in outside
               if graph.blobs[b].shape is not None and not kept_anyway(b))
    dropped = sum(graph.blobs[b].nbytes for b in redo if graph.blobs[b].shape is not None)
    dropped += sum(graph.blobs[op.outputs[1]].nbytes * 31 // 32 for op in packs
                   if graph.blobs[op.outputs[1]].shape is not None)
    return held, dropped


def _attention_bits(op):
    """Whether ``op`` is a fused ``Attention`` op writing its dropout mask
    bit-packed (its last output; ops/attention.py, ``packed_mask``)."""
    from ..ops.attention import packed
    return op.op_type == "Attention" and packed(op.attrs)


def _pack_mask(graph, op, grads):
    """Make Dropout ``op`` write its mask bit-packed (ops/dropout.py,
    ``packed_mask``) and its ``DropoutGrad`` ops ``grads`` read that; the
    float mask blob goes. Returns the packed blob's name."""
    mask = op.outputs[1]
    src = graph.blobs[mask]
    bits = graph.free_name(mask + PACKED)
    graph.add_blob(bits, None, "uint8", src.location, "data", attrs={"packed_of": mask})
    op.outputs[1] = bits
    op.attrs["packed_mask"] = True
    for c in grads:
        c.inputs[1] = bits
        c.attrs["packed_mask"] = True
    del graph.blobs[mask]
    return bits


def describe_recompute(graph):
    """One line on the recompute of ``graph`` (its ``recompute`` summary):
    the setting, the units, the blobs recomputed in the backward instead of
    kept from the forward, and the blobs their copies read (kept); None
    for a graph without it."""
    from ..base.progress_bar import human_bytes
    summary = graph.recompute
    if not summary or summary["setting"] == "none":
        return None
    units = summary["units"]
    no_gain = summary.get("no_gain", [])
    left = ""
    if no_gain:
        held, dropped = sum(h for _, h, _ in no_gain), sum(d for _, _, d in no_gain)
        names = [n for u, _, _ in no_gain for n in u]
        left = (f"{len(no_gain)} unit{'s' if len(no_gain) != 1 else ''} left as "
                f"{'they are' if len(no_gain) != 1 else 'it is'} ({', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}): each one's copies would hold at least "
                f"the bytes it drops (inputs the backward does not keep: "
                f"{human_bytes(held)} held for {human_bytes(dropped)} dropped in all; a chain "
                "net's layer, whose output the next layer keeps anyway)")
    if not units:
        why = ("no attention layer matched keeps an (N, H, T, T) tensor (the fused Attention "
               "op keeps none, with attn_dropout or without; fused: false takes the raw "
               "sub-graph)"
               if summary["setting"] == "selective" else
               "no unit of the layers matched has activations a copy could recompute"
               if not no_gain else left)
        return f"{summary['setting']}: nothing to recompute: {why}"

    # after the micro-batch composition (parallel/micro_batch.py) each blob
    # the summary names is one per copy, ``<blob>@mb<k>``: sized in copy 0,
    # what every copy recomputes and keeps
    copies = len({k for b in graph.blobs for k in re.findall(r"@mb(\d+)$", b)})

    def size(names):
        found = [graph.blobs.get(b) or graph.blobs.get(f"{b}@mb0") for b in names]
        return sum(b.nbytes for b in found if b is not None and b.shape is not None)
    layers = sum(len(u) for u in units)
    redo, saved = summary["recomputed"], summary["saved"]
    packed = summary.get("packed", [])
    kind = "unit" if summary["setting"] == "full" else "attention layer"
    return (f"{summary['setting']}: {len(units)} {kind}{'s' if len(units) != 1 else ''} "
            f"({layers} layer{'s' if layers != 1 else ''}); {len(redo)} activation blob(s) "
            f"({human_bytes(size(redo))}) recomputed in the backward instead of kept; their "
            f"copies read {len(saved)} kept blob(s) ({human_bytes(size(saved))}"
            + (f": {', '.join(saved[:4])}{', ...' if len(saved) > 4 else ''})" if saved
               else ")")
            + (f"; {len(packed)} dropout mask(s) kept bit-packed ({human_bytes(size(packed))})"
               if packed else "")
            + (f"; figures per micro-batch copy ({copies} copies)" if copies > 1 else "")
            + (f"; {left}" if left else ""))
