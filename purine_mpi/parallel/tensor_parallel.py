"""Tensor parallelism (``parallel.scheme: tensor``) as a graph composition.

Megatron-LM's split of a transformer's MLP (Shoeybi et al., 2019), found in
the net and applied to one replica's built graph (forward, backward and
updates) on each of the t ranks of a tensor-parallel group:

    x --fc A (columns)--> h_i --elementwise ops--> h_i --fc B (rows)--> y_i
                                                               Allreduce(y_i) = y

* fc A (a fully connected layer whose output reaches fc B through at
  least one element-wise op and nothing else: relu, gelu, tanh, sigmoid,
  dropout) keeps rows
  [i·O/t, (i+1)·O/t) of its (O, K) weight and of its bias: rank i computes
  the columns h_i of the hidden activation.
* fc B keeps columns [i·O/t, (i+1)·O/t) of its (P, O) weight (its input's
  last axis is the split one), computes the partial product y_i, and one
  ``Allreduce`` over the group (Megatron's g) sums them; only rank 0 of
  the group adds B's bias (the whole bias is on every rank and updated the
  same everywhere, its gradient being that of the summed y).
* An ``attention`` layer is split by heads the same way: its q, k and v
  projection (``qkv_weight`` (3C, C), rows q, k, v, heads contiguous) keeps
  rows [i·C/t, (i+1)·C/t) of each of the three blocks and of ``qkv_bias``,
  every attention op of the layer runs H/t heads, and the output
  projection (``proj_weight``) keeps the matching columns, then one
  ``Allreduce``. The ops drawing its ``attn_dropout`` mask get attr
  ``mask_split`` (``attention_dropouts``): shard i draws its heads' part
  of the unsplit layer's mask (base/philox.keep_mask), on the CPU only
  (``check_device``). So does a ``Dropout`` between an MLP's fc A and fc
  B (``column_dropouts``): shard i draws columns [i·O/t, (i+1)·O/t) of
  the unsplit activation's mask (attr ``mask_split`` on the last axis).
* In the backward pass the gradient reaching A's input from A (the qkv
  projection's input) is partial on each rank; one ``Allreduce``
  (Megatron's f) sums it. Everything outside
  the split pairs is replicated: every rank of a group reads the same batch.

The comm ops are ordinary graph ops (comm/ops.py), numbered (``seq``) in
topological order before any data-parallel bucket, the same on every rank.
With ``parallel.tensor_parallel`` t and a world of t·d ranks:

    rank = replica * t + shard     # 2 TP x 2 DP on 4 ranks:
                                   #   TP groups [0, 1], [2, 3]; DP groups [0, 2], [1, 3]

Each split parameter carries ``attrs["tensor_split"] = {axis, parts,
index, shape}`` (its whole shape), by which the trainer initialises the
shard as a slice of the whole filler value, and checkpoints gather the
shards into whole blobs on saving and slice them on loading (a checkpoint
of a 2-way run loads on 1 rank and back).
"""
from ..base.errors import ConfigError
from ..graph.grad import op_base
from ..graph.solver_graph import solver_states, state_name
from ..layers import layer_key
from .data_parallel import emit_after, next_seq, place_on_rank, sum_after
from .tensor_split import SHARD0_BIAS_ATTR, join_shards, split_of, take_shard  # noqa: F401

#: op types that map each element of their input to the same place of
#: their output (a column split passes through them)
ELEMENTWISE = ("Relu", "Gelu", "GELU", "Tanh", "Sigmoid", "Dropout")


def find_splits(graph):
    """The Megatron pairs of ``graph`` (forward ops read): a list of
    {"column": layer A, "row": layer B, "width": O, "through": [layers]}."""
    fwd = [op for op in graph.topo_order() if _forward(graph, op)]
    readers = {}
    for op in fwd:
        for b in op.inputs:
            readers.setdefault(b, []).append(op)
    param_uses = {}
    for op in graph.ops.values():
        if op.op_type == "InnerProduct" or op.name.endswith(".fwd"):
            for b in op.inputs:
                if graph.blobs[b].kind == "param":
                    param_uses.setdefault(b, set()).add(op_base(op.name))
    used, pairs = set(), []
    for op in graph.topo_order():  # attention layers: split by heads
        if op.op_type not in ("Attention", "AttentionScores"):
            continue
        layer = op.name.rsplit(".", 1)[0]
        qkv, proj = graph.ops.get(f"{layer}.qkv"), graph.ops.get(f"{layer}.proj")
        if qkv is None or proj is None or qkv.outputs[0] != op.inputs[0] or \
                layer in used or not (_own(qkv, param_uses) and _own(proj, param_uses)):
            continue
        used.update((layer, qkv.name, proj.name))
        pairs.append({"column": qkv.name, "row": proj.name, "layer": layer, "blocks": 3,
                      "heads": int(op.attrs["num_heads"]),
                      "width": int(graph.blobs[proj.inputs[1]].shape[0])})
    for a in fwd:
        if a.op_type != "InnerProduct" or op_base(a.name) in used or not _own(a, param_uses):
            continue
        cur, through = a.outputs[0], []
        while True:
            nxt = readers.get(cur, [])
            if len(nxt) != 1:
                break
            op = nxt[0]
            if op.op_type in ELEMENTWISE and op.inputs[0] == cur:
                through.append(op_base(op.name))
                cur = op.outputs[0]
                continue
            shape = graph.blobs[cur].shape
            axis = int(op.attrs.get("axis", 1))
            axis = axis + len(shape) if axis < 0 else axis
            if (through and op.op_type == "InnerProduct" and op.inputs[0] == cur
                    and axis == len(shape) - 1
                    and _own(op, param_uses) and op_base(op.name) not in used):
                width = int(graph.blobs[a.inputs[1]].shape[0])
                pairs.append({"column": op_base(a.name), "row": op_base(op.name),
                              "width": width, "through": through})
                used.update((op_base(a.name), op_base(op.name)))
            break
    order = {op.name: k for k, op in enumerate(graph.topo_order())}
    return sorted(pairs, key=lambda p: order[p["column"] if p["column"] in order
                                             else p["column"] + ".fwd"])


def splits_of(job):
    """The pairs tensor parallelism would split in ``job``'s net
    (``find_splits`` on one replica's training graph, as ``split_for``
    finds them when the scheme composes): empty where it splits nothing
    (``plan --choose`` lists tensor-parallel settings only where it splits
    something)."""
    from ..job.replica import build_train_graph
    graph, _ = build_train_graph(job)
    return find_splits(graph)


def _forward(graph, op):
    """Whether ``op`` is of the forward pass (not a gradient, update or
    solver op): every reader of an activation counts when a split is
    decided, also a layer's inner ops (``attn.qkv``)."""
    return ".bwd." not in op.name and not any(
        graph.blobs[b].kind in ("grad", "state", "param", "lr") for b in op.outputs)


def _own(op, param_uses):
    """Whether the op's parameters are used by its layer alone (a weight
    tied to another layer is not split)."""
    return all(param_uses.get(b, {op_base(op.name)}) == {op_base(op.name)}
               for b in op.inputs[1:])


def check_degree(pairs, degree, path):
    """A UserError (exit 2) naming ``parallel.tensor_parallel`` when a
    split width is not divisible by the degree, or nothing can be split."""
    if not pairs:
        raise ConfigError(path, "parallel.tensor_parallel", "scheme tensor found no "
                          "layers to split: it splits a fully connected layer whose output "
                          "reaches another fully connected layer (over its last axis) through "
                          "element-wise layers only (relu, gelu, dropout), e.g. a transformer's "
                          "MLP; use scheme: data for this net")
    heads = [p for p in pairs if "heads" in p and p["heads"] % degree]
    if heads:
        p = heads[0]
        raise ConfigError(path, "parallel.tensor_parallel", f"attention layer "
                          f"'{p['layer']}' has num_heads {p['heads']}, not divisible by the "
                          f"tensor-parallel degree {degree}; choose a degree that divides it")
    bad = [p for p in pairs if p["width"] % degree]
    if bad:
        p = bad[0]
        raise ConfigError(path, "parallel.tensor_parallel", f"layer '{p['column']}' has "
                          f"num_output {p['width']}, not divisible by the tensor-parallel degree "
                          f"{degree}; choose a degree that divides it")


def describe_splits(pairs, degree):
    """One line per split pair (the start-up block and ``graph --np N``)."""
    lines = []
    for p in pairs:
        if "heads" in p:
            lines.append(f"{p['layer']} (heads, {p['heads']} -> {p['heads'] // degree} per "
                         f"rank: q, k, v by columns, the output projection by rows, one "
                         "allreduce)")
            continue
        via = f" -> {' -> '.join(p['through'])}" if p["through"] else ""
        lines.append(f"{p['column']} (columns, {p['width']} -> {p['width'] // degree} per rank)"
                     f"{via} -> {p['row']} (rows, one allreduce)")
    return lines


def _shard(graph, name, axis, parts, index, states, blocks=1):
    """Give param ``name`` (and its solver state) the shape of shard
    ``index``: along ``axis``, the whole is ``blocks`` equal blocks (q, k, v)
    and the shard takes its part of each."""
    blob = graph.blobs[name]
    whole = tuple(blob.shape)
    shape = list(whole)
    shape[axis] //= parts
    blob.attrs["tensor_split"] = {"axis": axis, "parts": parts, "index": index,
                                  "shape": list(whole), "blocks": blocks}
    for n in [name] + [state_name(name, s) for s in states]:
        if n in graph.blobs:
            graph.blobs[n].shape = tuple(shape)


def _sum_after(graph, op, layer, group, seq, what):
    """``op``'s first output summed over ``group`` (data_parallel.sum_after)."""
    return sum_after(graph, op, graph.free_name(f"{layer}.tp_{what}"), group, seq, "tp_partial")


def split_graph(graph, pairs, degree, index, group, solver_type):
    """Apply the split of ``pairs`` (find_splits) for shard ``index`` of
    ``degree`` on ``graph`` (a training graph with backward and updates, or
    a forward-only test graph) in place. Returns the Allreduce ops added."""
    states = solver_states(solver_type) if solver_type else ()
    by_layer = {}
    for op in graph.ops.values():
        by_layer.setdefault(op_base(op.name).split(".bwd.")[0], []).append(op)
    fixes = []
    for p in pairs:
        a_ops, b_ops = by_layer[p["column"]], by_layer[p["row"]]
        a_fwd = next(op for op in a_ops if op.op_type == "InnerProduct")
        b_fwd = next(op for op in b_ops if op.op_type == "InnerProduct")
        for name in a_fwd.inputs[1:]:
            _shard(graph, name, 0, degree, index, states, p.get("blocks", 1))
        if "heads" in p:  # every op of the layer sees its shard's heads
            for op in graph.ops.values():
                if op.name.startswith(p["layer"] + ".") and "num_heads" in op.attrs:
                    op.attrs["num_heads"] = p["heads"] // degree
        for op, axis in split_dropouts(graph, p):  # before the shapes are re-derived
            op.attrs["mask_split"] = {"axis": axis, "parts": degree, "index": index}
        _shard(graph, b_fwd.inputs[1], 1, degree, index, states)
        if len(b_fwd.inputs) == 3 and index:  # the bias is added once, by shard 0
            # named (SHARD0_BIAS_ATTR): stage 3 gathers its bucket before this
            # op on every tensor shard, so every rank posts the same collectives
            b_fwd.attrs[SHARD0_BIAS_ATTR] = b_fwd.inputs[2]
            b_fwd.inputs = b_fwd.inputs[:2]
        x_shape = list(graph.blobs[b_fwd.inputs[0]].shape)
        x_shape[-1] //= degree
        for op in b_ops:
            if op.op_type == "InnerProductGradData":
                op.attrs["x_shape"] = x_shape
        fixes.append((b_fwd, p["row"], "sum"))  # forward: Megatron's g
        fixes += [(op, p["column"], "grad_sum") for op in a_ops  # backward: f
                  if op.op_type == "InnerProductGradData"]
    order = {op.name: k for k, op in enumerate(graph.topo_order())}
    seq = next_seq(graph)
    added, after = [], {}
    for op, layer, what in sorted(fixes, key=lambda f: order[f[0].name]):
        added.append(_sum_after(graph, op, layer, group, seq, what))
        after[op.name] = added[-1].name
        seq += 1
    emit_after(graph, after)
    # re-derive every produced shape from the shards
    produced = {o for op in graph.ops.values() for o in op.outputs}
    for name in produced:
        graph.blobs[name].shape = None
    graph.infer_shapes()
    return added


def attention_dropouts(graph, layer):
    """The ops of attention layer ``layer`` that draw the dropout mask of
    its (N, H, T, T) probabilities: the fused ``Attention`` and
    ``AttentionGrad`` with attr ``dropout`` > 0, and the raw path's
    ``Dropout`` whose output the ``AttentionContext`` reads. Split by heads,
    each gets attr ``mask_split`` (axis 1): it draws its heads' part of the
    unsplit layer's mask (base/philox.keep_mask), not the mask of a whole
    array of H/t heads, which every shard would draw alike."""
    ops = [op for op in graph.ops.values() if op.name.startswith(layer + ".")]
    probs = {op.inputs[0] for op in ops if op.op_type == "AttentionContext"}
    return [op for op in ops
            if (op.op_type in ("Attention", "AttentionGrad")
                and float(op.attrs.get("dropout", 0.0)) > 0)
            or (op.op_type == "Dropout" and op.outputs[0] in probs
                and op.attrs.get("phase", "train") == "train")]


def column_dropouts(graph, pair):
    """The training ``Dropout`` ops (ratio > 0) among the element-wise
    layers between the split fc layers of MLP pair ``pair`` (its
    ``through``): they drop the column-split activation, (N, O/t) or (N, T,
    O/t), and each gets attr ``mask_split`` on its last axis: its columns'
    part of the unsplit layer's mask (base/philox.keep_mask), not the mask
    of a whole array of O/t columns, which every shard would draw alike."""
    through = set(pair.get("through", ()))
    return [op for op in graph.topo_order()
            if op.op_type == "Dropout" and op_base(op.name) in through
            and op.attrs.get("phase", "train") == "train"
            and float(op.attrs.get("ratio", 0.5)) > 0]


def split_dropouts(graph, pair):
    """(op, axis) of each op drawing a dropout mask of ``pair``'s split
    activation, the axis its shards split: an attention layer's
    (``attention_dropouts``, its (N, H, T, T) probabilities by heads, axis
    1) or an MLP's (``column_dropouts``, the last axis)."""
    if "heads" in pair:
        return [(op, 1) for op in attention_dropouts(graph, pair["layer"])]
    return [(op, len(graph.blobs[op.inputs[0]].shape) - 1)
            for op in column_dropouts(graph, pair)]


def check_device(graph, pairs, job):
    """A UserError (exit 2) naming the layer's key when a dropout of a
    split activation runs on a GPU: an attention layer's ``attn_dropout``
    (split by heads), a ``dropout`` layer's ``ratio`` between an MLP's
    split fc layers. The device kernels (cuda/dropout.cu, cuDNN's SDPA)
    count a shard's local elements, which would give every shard the same
    masks."""
    from .placement import asks_for_gpu
    if not asks_for_gpu(job):
        return
    names = list(job.layer_names)
    for p in pairs:
        ops = split_dropouts(graph, p)
        if not ops:
            continue
        if "heads" in p:
            layer, key, what = p["layer"], "attn_dropout", "attention dropout split by heads"
        else:
            layer, _, tag = op_base(ops[0][0].name).partition(".")
            cfg = job.net[names.index(layer)] if layer in names else {}
            if tag:  # a layer's own dropout (transformer's <layer>.resid_drop)
                key = tag.replace("_drop", "_dropout")
            else:    # a dropout layer
                key = "dropout_ratio" if "dropout_ratio" in cfg and "ratio" not in cfg \
                    else "ratio"
            what = f"dropout of the activation of '{p['column']}' split by columns"
        full = f"{layer_key(job.net_keys, names.index(layer))}.{key}" if layer in names else key
        raise ConfigError(job.path, full, f"layer '{layer}': {what} "
                          "(parallel.tensor_parallel) draws each shard's part of the "
                          f"unsplit mask on the CPU only, not on a GPU; set {key}: 0 or "
                          "device: -1")


def split_for(graph, job, lay, train=True):
    """Split ``graph`` (one replica's, whole) in place for this rank's
    shard (``lay.shard`` of ``lay.tensor``), its allreduces over its tensor
    group (``lay.tensor_ranks()``): the pairs of ``find_splits``, checked
    (exit 2 naming the key). Returns the pairs."""
    pairs = find_splits(graph)
    check_degree(pairs, lay.tensor, job.path)
    check_device(graph, pairs, job)
    split_graph(graph, pairs, lay.tensor, lay.shard, lay.tensor_ranks(),
                job.solver.type if train else None)
    return pairs


def compose_tensor(graph, grads, job, world, lay, train=True, reduce=None):
    """This rank's slice under ``scheme: tensor`` (see the module docstring):
    the split pairs, their allreduces over this rank's tensor group, then
    (with several replicas) the data-parallel buckets over the ranks that
    hold the same shard. ``reduce(graph, grads, group)``: another reduction
    of the split gradients over ``group`` (the ranks holding this shard, one
    per replica; also with one replica) in place of the buckets' allreduce,
    returning the Composition's fields it fills (scheme sharded: its ZeRO
    rewrite, ``shard_plan``). Returns the Composition (its ``tensor_plan``:
    the pairs)."""
    from .schemes.base import Composition
    degree = lay.tensor
    pairs = split_for(graph, job, lay, train)
    reduces = train and (lay.replicas > 1 or reduce is not None)
    split = getattr(world, "split_groups", None)
    if split is not None:  # a live MPI world (graph --np composes offline): same order everywhere
        split(lay.tensor_groups())
        if reduces:
            split(lay.shard_groups())
    fields = {}
    if reduces:
        sum_over_shard_replicas(graph, lay)
    if reduces and reduce is not None:
        fields = reduce(graph, grads, lay.shard_ranks())
    elif reduces:
        from .data_parallel import compose_data_parallel
        dp = lay.shard_ranks()
        # parallel.grad_dtype: bf16 reduces these buckets in bfloat16; the
        # tensor group's allreduces of activations (split_graph) stay float32
        plan = compose_data_parallel(graph, grads, lay.replicas, lay.replica,
                                     check_collectives=False,
                                     wire_dtype=job.parallel.wire_dtype(),
                                     **job.parallel.bucket_settings())
        for b in plan:
            graph.ops[b["op"]].attrs["group"] = list(dp)
            b["group"] = list(dp)
        fields = {"bucket_plan": plan}
    place_on_rank(graph, world.rank)
    # nothing is deferred (compose.defer_update_applies): the memory plan
    # need not keep what a deferred tail would touch
    graph.deferrable = False
    graph.infer_shapes().validate()
    if train and job.parallel.check_collectives and split is not None:
        from ..comm.verify import check_collectives
        check_collectives(graph, world)
    return Composition(graph, lay, tensor_plan=describe_splits(pairs, degree), **fields)


def sum_over_shard_replicas(graph, lay):
    """A synchronised batch norm's sums (ops/batchnorm.py; outside the split
    pairs, so every shard of a group holds the same ones) over the replicas
    alone: the ranks holding this rank's shard of its stage,
    ``lay.shard_ranks()`` (schemes tensor, sharded with tensor shards and
    hybrid: the stage's replicas). The tensor group's allreduces and the
    sums numbered together in emission order (a collective never before one
    it waits for; a stage's slice is emitted in its schedule's order):
    numbered after the allreduces, a forward sum would be posted behind the
    tensor allreduce that waits for it (a hang). Returns the sums' Allreduce
    ops' names."""
    from .data_parallel import sum_over_replicas
    from .sharding import emission_order
    synced = [op.name for op in sum_over_replicas(graph, lay.shard_ranks())]
    if not synced:
        return synced
    group = lay.tensor_ranks()
    names = synced + [op.name for op in graph.ops.values()
                      if op.op_type == "Allreduce" and op.attrs.get("group") == group]
    first = min(graph.ops[n].attrs["seq"] for n in names)
    for k, n in enumerate(emission_order(graph, names)):
        graph.ops[n].attrs["seq"] = first + k
    return synced


# ---------------------------------------------------------------- weights
def whole_shape(blob):
    """The shape of a param's whole blob (its own when it is not split)."""
    split = split_of(blob)
    return tuple(split["shape"]) if split else tuple(blob.shape)


def initial_value(blob, seed):
    """A param's value from its filler: a split param's shard is its slice
    of the whole blob's value, so every degree starts from the same net."""
    import copy
    from ..layers.fillers import fill
    split = split_of(blob)
    if not split:
        return fill(blob, seed)
    whole = copy.copy(blob)
    whole.shape = tuple(split["shape"])
    return take_shard(split, fill(whole, seed))


def param_split(graph, name):
    """The split of a param blob or of its solver state (``<param>.<state>``)."""
    blob = graph.blobs.get(name)
    split = split_of(blob) if blob is not None else None
    if split is None and "." in name:
        owner = graph.blobs.get(name.rsplit(".", 1)[0])
        split = split_of(owner) if owner is not None and owner.kind == "param" else None
    return split


def gather_whole(graph, layout, parts, splits=None):
    """Rank 0's whole params and solver state from every rank's
    ``(params, solver)`` (``parts``, world order): the shards of each of
    replica 0's tensor groups (one per stage) joined, the other blobs from
    the group's shard 0. ``splits``: {param: its ``tensor_split`` or None}
    of the params rank 0's ``graph`` does not hold (other stages')."""
    params, state = {}, {}   # the weights, the solver's state
    for s in range(layout.stages):
        ranks = layout.tensor_ranks(0, s)
        first_params, first_state = parts[ranks[0]][:2]
        params.update(first_params)
        state.update(first_state)
        for p in first_params:
            split = splits.get(p) if splits and p in splits else split_of(graph.blobs[p])
            if split:
                params[p] = join_shards(split, [parts[r][0][p] for r in ranks])
                if p in state:
                    state[p] = {x: join_shards(split, [parts[r][1][p][x] for r in ranks])
                                for x in state[p]}
    return params, state


def add_tensor_clip(graph, clip, lay, group=None):
    """``solver.clip_gradients`` under tensor parallelism: the squared norms
    of a group's ranks add up (one Allreduce over ``group``, default the
    tensor group; with stages every rank of the replica), a split
    parameter's shards each counted on their rank, a whole (replicated)
    parameter only on shard 0 of its tensor group (its norm scale is 0
    elsewhere)."""
    from ..graph.clip import add_clip, update_ops
    param_of = {op.inputs[1]: graph.storage_root(op.inputs[0]) for op in update_ops(graph)}
    add_clip(graph, clip, group=lay.tensor_ranks() if group is None else group)
    count_whole_once(graph, lay, param_of)
    return graph


def count_whole_once(graph, lay, param_of):
    """The clip norm (``clip.norm``, graph/clip.add_clip) of shard > 0 of a
    tensor group counts the split parameters' gradients alone: a whole
    (replicated) parameter is counted on shard 0 only (its scale is 0
    elsewhere). ``param_of``: {gradient the norm reads: its parameter}. A
    pipeline stage without parameters adds a zero (a Constant): nothing to
    count."""
    norm = graph.ops.get("clip.norm")
    if norm is not None and norm.op_type == "GradNormSq" and lay.shard:
        norm.attrs["scales"] = [s if split_of(graph.blobs[param_of[g]]) else 0.0
                                for g, s in zip(norm.inputs, norm.attrs["scales"])]
