"""GPT-2 in Hugging Face's layout <-> our GPT's parameters:
``train JOB --init model.safetensors`` and ``export hf JOB --weights W --out DIR``
(docs/transformers.md, "Hugging Face"; docs/formats.md).

The net must have GPT-2's structure, as jobs/gpt_*.yaml have: a token
embedding, a position embedding, blocks of [layer_norm, attention, residual
sum, layer_norm, fc, gelu, fc, residual sum], a final layer_norm and the head
fc over the last axis. ``gpt2_layout(job)`` reads it from the test-phase
net (any layer names; test-phase Dropout ops pass through) and gives the
tensor map, GPT2Config's fields, and what of the net GPT2Config cannot say
(``differences``: export refuses them, ``--init`` needs only the map):

    transformer.wte.weight               <- the embedding's weight (V, C)
    transformer.wpe.weight               <- the position embedding's weight (P, C)
    transformer.h.N.ln_1.weight / .bias  <- block N's first layer_norm
    transformer.h.N.attn.c_attn.weight   <- the attention's qkv_weight, transposed: (C, 3C)
    transformer.h.N.attn.c_attn.bias     <- its qkv_bias
    transformer.h.N.attn.c_proj.*        <- its proj_weight (transposed), proj_bias
    transformer.h.N.ln_2.weight / .bias  <- block N's second layer_norm
    transformer.h.N.mlp.c_fc.*           <- the block's first fc (weight transposed), bias
    transformer.h.N.mlp.c_proj.*         <- its second fc (weight transposed), bias
    transformer.ln_f.weight / .bias      <- the final layer_norm
    lm_head.weight                       tied to wte: not written; when read into a
                                         tied net, it must equal wte (refused else)

GPT-2's Conv1D keeps its weight as [in, out], the transpose of our fc's
(out, in) (why interop/onnx_gpt.py's ``linear`` transposes too); q, k and v
lie in that order along c_attn's output axis, heads contiguous, as in our
qkv_weight's rows (layers/transformer.py). Files downloaded from the Hub
name the tensors without ``transformer.`` and hold the causal-mask buffers
``h.N.attn.bias`` / ``masked_bias``: both are read as well. Tensors are
read and written with the ``safetensors`` package (its numpy API).
"""
import json
import os
from dataclasses import dataclass, field

import numpy as np

from ..base.errors import InitMismatch, UserError, one_line
from ..base.runfiles import make_folder, write_replacing, write_text_replacing
from ..job.replica import param_layer

INSTALL = "pip install 'purine_mpi[hf]' (or pip install safetensors)"
#: the weights file of a Hugging Face model folder
WEIGHTS = "model.safetensors"
#: the vocabulary of a run on subword tokens (Hugging Face tokenizers' JSON)
TOKENIZER = "tokenizer.json"
#: the files of a folder that transformers.AutoTokenizer builds a GPT-2
#: tokenizer from (GPT2TokenizerFast: tokenizer.json, else the BPE's
#: vocab.json and merges.txt)
TOKENIZER_FILES = (TOKENIZER, "vocab.json", "merges.txt")
PREFIX = "transformer."
#: ops of the test phase that hand their input on (a Dropout outside training)
_PASS = ("Dropout",)
#: ops that read the logits and are no part of the model
_HEADLESS = ("SoftmaxLoss", "Accuracy", "Softmax")
_ACTIVATION = {"tanh": "gelu_new", "none": "gelu"}


@dataclass
class Layout:
    """``tensors`` [(HF name, our param, transposed)], ``config`` (GPT2Config's
    fields), ``differences`` (what GPT2Config cannot express, one phrase each)."""
    graph: object
    tensors: list = field(default_factory=list)
    config: dict = field(default_factory=dict)
    differences: list = field(default_factory=list)


def _layer(op):
    return op.name.rsplit(".", 1)[0]


def _test_net(job):
    """The test-phase net of ``job`` on one token (the data file is not read)."""
    from ..graph import Graph
    from ..layers import build_net
    if job.graph is not None or not job.net:
        raise UserError(f"{job.path}: GPT-2's layout needs a job with a net: list (a GPT as "
                        "docs/transformers.md builds it)")
    first = job.net[0]
    if first.get("type") not in ("embedding", "embed"):
        raise UserError(f"{job.path}: the net is not a GPT: GPT-2 starts with a token "
                        f"embedding, this net with layer '{first.get('name')}' "
                        f"({first.get('type')})")
    g = Graph(job.name)
    g.add_blob("data", (1, 1), "int32")
    g.add_blob("label", (1, 1), "int32")
    build_net(job.net, "test", (g, job.path, job.net_keys))
    return g


class _Walk:
    """The net's ops in order, taken one at a time against GPT-2's structure."""

    def __init__(self, graph, path):
        self.ops, self.alias, self.drops, self.path = [], {}, [], path
        scores = {op.outputs[0] for op in graph.ops.values() if op.op_type == "AttentionScores"}
        for op in graph.ops.values():
            if op.op_type in _PASS:
                self.alias[op.outputs[0]] = op.inputs[0]
                self.drops.append(op)
            elif op.op_type not in _HEADLESS or op.inputs[0] in scores:
                self.ops.append(op)  # the softmax of fused: false attention is the model's
        self.i, self.last = 0, None

    def src(self, blob):
        while blob in self.alias:
            blob = self.alias[blob]
        return blob

    def peek(self, k=0):
        return self.ops[self.i + k] if self.i + k < len(self.ops) else None

    def take(self, types, reads, what):
        op = self.peek()
        if op is None or op.op_type not in types or (reads is not None
                                                      and self.src(op.inputs[0]) != reads):
            found = "the end of the net" if op is None else \
                f"layer '{_layer(op)}' ({op.op_type})"
            after = f"after layer '{_layer(self.last)}' " if self.last is not None else ""
            raise UserError(f"{self.path}: the net is not GPT-2's structure: {after}GPT-2 has "
                            f"{what}, this net has {found}")
        self.i += 1
        self.last = op
        return op

    def residual(self, a, b, what):
        op = self.take(("Eltwise",), None, what)
        coeff = op.attrs.get("coeff")
        if op.attrs.get("operation", "sum") != "sum" or len(op.inputs) != 2 or \
                {self.src(x) for x in op.inputs} != {a, b} or \
                (coeff is not None and any(float(c) != 1.0 for c in coeff)):
            raise UserError(f"{self.path}: the net is not GPT-2's structure: layer "
                            f"'{_layer(op)}' is not {what}")
        return op.outputs[0]


def _params(op, names, tensors, prefix, transposed=False):
    """Map an op's parameters (inputs after the first) to ``prefix`` + names."""
    for name, ours in zip(names, op.inputs[1:]):
        tensors.append((prefix + name, ours, transposed and name == "weight"))


def _uniform(values, what, differences):
    """The one value of [(layer, value)], noting a difference when there are several."""
    distinct = list(dict.fromkeys(v for _, v in values))
    if len(distinct) > 1:
        differences.append(f"{what} differs between layers ("
                           + ", ".join(f"{name}: {v}" for name, v in values)
                           + "); GPT2Config has one for the whole model")
    return distinct[0] if distinct else None


def gpt2_layout(job):
    """The ``Layout`` of ``job``'s net; a UserError naming the layer where its
    structure leaves GPT-2's."""
    g = _test_net(job)
    w = _Walk(g, job.path)
    cfg = {layer["name"]: layer for layer in job.net}
    out, diffs = Layout(g), []
    t = out.tensors
    emb = w.take(("Embedding",), "data", "the token embedding (wte)")
    t.append((PREFIX + "wte.weight", emb.inputs[1], False))
    pos = w.take(("PositionEmbedding",), emb.outputs[0], "the position embedding (wpe)")
    t.append((PREFIX + "wpe.weight", pos.inputs[1], False))
    x = pos.outputs[0]
    eps, heads, inner, gelu, attn_drop, resid_drop, biases = [], [], [], [], [], [], []
    causal = []
    n = 0
    while True:
        ln = w.take(("LayerNorm",), x, f"a layer_norm ({'ln_1 of block ' + str(n)} or ln_f)")
        eps.append((_layer(ln), float(ln.attrs.get("eps", 1e-5))))
        nxt = w.peek(1)
        if nxt is None or not nxt.op_type.startswith("Attention"):
            break  # the final layer norm: the head follows
        p = f"{PREFIX}h.{n}."
        _params(ln, ("weight", "bias"), t, p + "ln_1.")
        qkv = w.take(("InnerProduct",), ln.outputs[0], "the attention's c_attn")
        att = w.take(("Attention", "AttentionScores"), qkv.outputs[0], "the attention")
        if att.op_type == "AttentionScores":
            sm = w.take(("Softmax",), att.outputs[0], "the attention's softmax")
            att = w.take(("AttentionContext",), sm.outputs[0], "the attention's context")
        proj = w.take(("InnerProduct",), att.outputs[0], "the attention's c_proj")
        name = _layer(qkv)
        heads.append((name, int(att.attrs["num_heads"])))
        causal.append((name, bool(att.attrs.get("causal", True))))
        layer = cfg.get(name, {})
        attn_drop.append((name, float(layer.get("attn_dropout", 0.0))))
        resid_drop.append((name, float(layer.get("resid_dropout", 0.0))))
        _params(qkv, ("weight", "bias"), t, p + "attn.c_attn.", True)
        _params(proj, ("weight", "bias"), t, p + "attn.c_proj.", True)
        biases += [(name, len(qkv.inputs) == 3 and len(proj.inputs) == 3)]
        r = w.residual(x, proj.outputs[0], "the residual sum after the attention")
        ln2 = w.take(("LayerNorm",), r, f"ln_2 of block {n} (a layer_norm)")
        eps.append((_layer(ln2), float(ln2.attrs.get("eps", 1e-5))))
        _params(ln2, ("weight", "bias"), t, p + "ln_2.")
        fc = w.take(("InnerProduct",), ln2.outputs[0], "the MLP's c_fc (an fc)")
        act = w.take(("Gelu",), fc.outputs[0], "the MLP's GELU")
        mp = w.take(("InnerProduct",), act.outputs[0], "the MLP's c_proj (an fc)")
        inner.append((_layer(fc), int(g.blobs[fc.inputs[1]].shape[0])))
        gelu.append((_layer(act), str(act.attrs.get("approximate", "none"))))
        for op in (fc, mp):
            biases.append((_layer(op), len(op.inputs) == 3))
        _params(fc, ("weight", "bias"), t, p + "mlp.c_fc.", True)
        _params(mp, ("weight", "bias"), t, p + "mlp.c_proj.", True)
        for d in w.drops:
            if w.src(d.inputs[0]) == mp.outputs[0]:
                resid_drop.append((_layer(d), float(d.attrs.get("ratio", 0.0))))
        x = w.residual(r, mp.outputs[0], "the residual sum after the MLP")
        n += 1
    if n == 0:
        raise UserError(f"{job.path}: the net is not GPT-2's structure: it has no block "
                        "(layer_norm, attention, ...) between the embeddings and ln_f")
    _params(ln, ("weight", "bias"), t, PREFIX + "ln_f.")
    head = w.take(("InnerProduct",), ln.outputs[0], "the head (lm_head, an fc)")
    if w.peek() is not None:
        extra = w.peek()
        raise UserError(f"{job.path}: the net is not GPT-2's structure: after the head "
                        f"'{_layer(head)}' GPT-2 has nothing, this net has layer "
                        f"'{_layer(extra)}' ({extra.op_type})")
    if head.inputs[1] != emb.inputs[1]:
        diffs.append(f"layer '{_layer(head)}' is not tied to the embedding "
                     f"(tie_weight: {_layer(emb)}); GPT-2's lm_head is")
        t.append(("lm_head.weight", head.inputs[1], False))
    if len(head.inputs) == 3:
        diffs.append(f"layer '{_layer(head)}' has a bias; GPT-2's lm_head has none")
    for name, has in biases:
        if not has:
            diffs.append(f"layer '{name}' has no bias (bias_term: false); GPT-2's c_attn, "
                         "c_proj and c_fc have one")
    for name, is_causal in causal:
        if not is_causal:
            diffs.append(f"layer '{name}' is not causal; GPT-2's attention is")
    embd_drop = []
    for d in w.drops:
        where = w.src(d.inputs[0])
        if where == pos.outputs[0]:
            embd_drop.append((_layer(d), float(d.attrs.get("ratio", 0.0))))
        elif not any(_layer(d) == name for name, _ in resid_drop):
            diffs.append(f"dropout layer '{_layer(d)}' is where GPT-2 has none")
    v, c = (int(s) for s in g.blobs[emb.inputs[1]].shape)
    out.config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": v, "n_positions": int(g.blobs[pos.inputs[1]].shape[0]), "n_embd": c,
        "n_layer": n, "n_head": _uniform(heads, "num_heads", diffs),
        "n_inner": _uniform(inner, "the MLP width (num_output of c_fc)", diffs),
        "activation_function": _ACTIVATION[_uniform(gelu, "gelu's approximate", diffs)],
        "layer_norm_epsilon": _uniform(eps, "layer_norm's eps", diffs),
        "embd_pdrop": _uniform(embd_drop, "the embedding dropout", diffs) or 0.0,
        "attn_pdrop": _uniform(attn_drop, "attn_dropout", diffs),
        "resid_pdrop": _uniform(resid_drop, "the residual dropout (resid_dropout and the "
                                            "dropout after the MLP)", diffs) or 0.0,
        "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": True,
        "use_cache": True, "bos_token_id": None, "eos_token_id": None,
    }
    out.differences = diffs
    return out


# ------------------------------------------------------------------ reading
def _safetensors(what):
    try:
        import safetensors.numpy as st
    except ImportError:
        raise UserError(f"{what} needs the safetensors package: {INSTALL}") from None
    return st


def read_tensors(path):
    """{HF name, with its ``transformer.`` prefix: array} of a safetensors file
    (the Hub's unprefixed names and its causal-mask buffers handled)."""
    st = _safetensors("--init MODEL.safetensors")
    _check_file(path)
    try:
        raw = _load_bfloat16(path) if "BF16" in _dtypes(path) else st.load_file(path)
    except Exception as e:  # the package's own error types: a damaged or foreign file
        raise _unreadable(path, e) from None
    out = {}
    for name, value in raw.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # GPT-2's causal-mask buffers, not weights
        out[_prefixed(name)] = value
    return out


def _prefixed(name):
    """A safetensors file's tensor name with its ``transformer.`` prefix (the
    Hub's files leave it out)."""
    return name if name.startswith((PREFIX, "lm_head.")) else PREFIX + name


def _check_file(path):
    if not os.path.isfile(path):
        raise UserError(f"weights file '{path}' not found" if not os.path.isdir(path) else
                        f"weights file '{path}' is a directory; give its {WEIGHTS}")


def _unreadable(path, e):
    return UserError(f"weights file '{path}' is not a safetensors file numpy can read "
                     f"({type(e).__name__}: {e})")


#: safetensors' dtype names -> NumPy's (little-endian, as the format stores them)
_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U8": "u1", "BOOL": "?"}


def _header(f):
    """The JSON header of an open safetensors file and the offset of its data."""
    size = int.from_bytes(f.read(8), "little")
    if not 2 <= size <= 100 * 2 ** 20:
        raise ValueError(f"a header of {size} bytes")
    return json.loads(f.read(size).decode("utf-8")), 8 + size


def _dtypes(path):
    """The dtype names the file's header gives its tensors (none when it has
    no readable header: the package then says why)."""
    try:
        with open(path, "rb") as f:
            header, _ = _header(f)
        return {t.get("dtype") for name, t in header.items() if name != "__metadata__"}
    except (OSError, ValueError, AttributeError):
        return set()


def _load_bfloat16(path):
    """{name: array} of a safetensors file holding bfloat16 tensors, which
    NumPy (safetensors.numpy) has no dtype for: each is widened to float32
    exactly (a bfloat16's 16 bits are the top half of a float32's), the
    other dtypes read as they are."""
    out = {}
    with open(path, "rb") as f:
        header, base = _header(f)
        for name, t in header.items():
            if name == "__metadata__":
                continue
            start, end = t["data_offsets"]
            f.seek(base + start)
            data = f.read(end - start)
            if len(data) != end - start:
                raise ValueError(f"tensor '{name}' runs past the end of the file")
            if t["dtype"] == "BF16":
                value = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
            elif t["dtype"] in _NUMPY:
                value = np.frombuffer(data, _NUMPY[t["dtype"]]).copy()
            else:
                raise ValueError(f"tensor '{name}' has dtype {t['dtype']}")
            out[name] = value.reshape(t["shape"])
    return out


def hf_load_nbytes(path, job):
    """The host bytes ``hf_params`` holds at its most (``plan --init``'s
    start-up load), from the file's header and ``job``'s layout. Reading
    (``read_tensors``): safetensors' ``load_file`` copies every tensor out
    of the file, whose pages it maps until the last, into an array of its
    own (the file's bytes and the arrays); a bfloat16 file is read a tensor
    at a time, each widened to float32 (the arrays and, at most, a tensor's
    bytes and its uint32 widening). Then, the file let go, the arrays read
    (less the Hub's causal-mask buffers) beside the copies the layout makes
    (a Conv1D weight transposed, a tensor of another dtype than its blob)
    and a tied head's comparison with the embedding (a byte an element)."""
    _check_file(path)
    try:
        with open(path, "rb") as f:
            header, _ = _header(f)
        tensors = {_prefixed(name): {"dtype": t["dtype"], "shape": [int(d) for d in t["shape"]],
                                     "data_offsets": [int(o) for o in t["data_offsets"]]}
                   for name, t in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _unreadable(path, e) from None
    bf16 = any(t["dtype"] == "BF16" for t in tensors.values())

    def count(t):
        return int(np.prod(t["shape"], dtype=np.int64))

    def stored(t):
        return int(t["data_offsets"][1] - t["data_offsets"][0])

    def read(t):  # the array read_tensors makes of it
        return 4 * count(t) if t["dtype"] == "BF16" else stored(t)
    arrays = sum(read(t) for t in tensors.values())
    if bf16:
        load = arrays + max((stored(t) + (4 * count(t) if t["dtype"] == "BF16" else 0)
                             for t in tensors.values()), default=0)
    else:
        load = os.path.getsize(path) + arrays
    kept = sum(read(t) for name, t in tensors.items()
               if not name.endswith((".attn.bias", ".attn.masked_bias")))
    layout = gpt2_layout(job)
    blobs, copies = layout.graph.blobs, 0
    for hf, ours, transposed in layout.tensors:
        t = tensors.get(hf)
        if t is None:
            continue
        blob = blobs[ours]
        dtype = np.dtype(np.float32 if t["dtype"] == "BF16" else _NUMPY.get(t["dtype"], "<f4"))
        # np.ascontiguousarray copies a transposed matrix (one of a single
        # row or column is contiguous already) and a cast
        if dtype != np.dtype(blob.dtype) or (transposed and len(t["shape"]) > 1 and
                                             min(t["shape"]) > 1):
            copies += int(blob.nbytes)
    wte, head = tensors.get(PREFIX + "wte.weight"), tensors.get("lm_head.weight")
    if wte is not None and head is not None and \
            all(hf != "lm_head.weight" for hf, _, _ in layout.tensors):
        copies += count(wte)  # np.array_equal's comparison
    return max(load, kept + copies)


def hf_params(path, job, skip=()):
    """({our param: array}, note or None): the GPT-2 tensors of the safetensors
    file ``path`` in our layout, for ``job``'s net; the layers of ``skip``
    (``--init-skip``) are left out. A tensor the net needs that the file
    lacks, or one of another shape, is an InitMismatch naming the tensor."""
    layout = gpt2_layout(job)
    tensors = read_tensors(path)
    blobs = layout.graph.blobs
    values, missing = {}, []
    for hf, ours, transposed in layout.tensors:
        layer = param_layer(ours)
        if layer in skip:
            continue
        if hf not in tensors:
            missing.append(f"{hf} (for {ours})")
            continue
        value = tensors[hf]
        shape = tuple(blobs[ours].shape)
        want = shape[::-1] if transposed else shape
        if tuple(value.shape) != want:
            how = ", Conv1D's [in, out]: our (out, in) transposed" if transposed else ""
            raise InitMismatch(f"weights file '{path}': tensor '{hf}' has shape "
                               f"{list(value.shape)}, this net expects {list(want)} (layer "
                               f"'{layer}', {ours}{how})",
                               f"; to start layer '{layer}' afresh instead (fine-tuning a "
                               f"changed layer), give --init-skip {layer}")
        value = value.T if transposed else value
        values[ours] = np.ascontiguousarray(value, dtype=blobs[ours].dtype)
    if missing:
        raise InitMismatch(f"weights file '{path}' lacks {len(missing)} tensor(s) of this net: "
                           f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}",
                           "; to leave a layer at its fresh initialisation (fine-tuning), "
                           "name it with --init-skip LAYER")
    _check_hf_config(path, layout)
    wte, head = tensors.get(PREFIX + "wte.weight"), tensors.get("lm_head.weight")
    tied = all(hf != "lm_head.weight" for hf, _, _ in layout.tensors)
    if tied and head is not None and wte is not None and not np.array_equal(head, wte):
        raise UserError(f"weights file '{path}': its lm_head.weight is not its "
                        "transformer.wte.weight (a model of tie_word_embeddings false), and "
                        "this net's head is tied to the embedding (tie_weight): the file's "
                        "head would be dropped; give the head layer its own weight (no "
                        "tie_weight, bias_term: false) to read it")
    used = {hf for hf, _, _ in layout.tensors} | {"lm_head.weight"}
    extra = sorted(set(tensors) - used)
    shown = ", ".join(map(one_line, extra[:8])) + (" ..." if len(extra) > 8 else "")
    note = (f"note: {path}: {len(extra)} tensor(s) of the file are not used by this net: "
            f"{shown}") if extra else None
    return values, note


#: GPT2Config's activation_function values of each of our gelu's approximate
_SAME_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def _check_hf_config(path, layout):
    """The config.json beside ``path`` (a GPT2LMHeadModel folder, a Hub
    download), when there is one, must describe the net's computation: what
    the tensor shapes cannot tell apart (heads, eps, GELU, the attention's
    scaling) differing is a UserError naming each field, never a model
    that loads and computes something else."""
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
    if not os.path.isfile(cfg_path):
        return
    try:
        with open(cfg_path, encoding="utf-8") as f:
            theirs = json.load(f)
    except (OSError, ValueError):
        return  # not a model's config: the tensors alone are read
    if not isinstance(theirs, dict) or theirs.get("model_type") != "gpt2":
        return
    ours, diffs = layout.config, []
    approximate = {"gelu_new": "tanh", "gelu": "none"}[ours["activation_function"]]
    activation = theirs.get("activation_function", "gelu_new")
    if _SAME_GELU.get(activation) != approximate:
        diffs.append(f"activation_function {activation!r}, this net's gelu has approximate: "
                     f"{approximate}")
    for key, default, what in (("n_head", 12, "num_heads"),
                               ("layer_norm_epsilon", 1e-5, "layer_norm eps")):
        if theirs.get(key, default) != ours[key]:
            diffs.append(f"{key} {theirs.get(key, default)}, this net has {what} {ours[key]}")
    for key, default, want in (("scale_attn_weights", True, True),
                               ("scale_attn_by_inverse_layer_idx", False, False)):
        if bool(theirs.get(key, default)) != want:
            diffs.append(f"{key} {theirs.get(key, default)}, this net's attention scales by "
                         "1/sqrt(head width) in every layer")
    if diffs:
        raise UserError(f"weights file '{path}': its {cfg_path} describes another GPT-2 than "
                        f"this net computes: {'; '.join(diffs)} (the tensors fit, the results "
                        "would not: set the net's keys to the model's)")


# ------------------------------------------------------------------ writing
def export_hf(job, weights_path, out_dir):
    """Write ``out_dir``/model.safetensors and config.json (GPT2LMHeadModel)
    of ``job``'s net with the params of ``weights_path``, and tokenizer.json
    when the weights file holds a vocabulary; returns a one-line summary.
    A net GPT2Config cannot express is a UserError naming each difference."""
    from ..job.checkpoint_check import check_finite
    from ..job.checkpoint_file import saved_tokenizer
    from ..job.replica import trained_values
    st = _safetensors("export hf")
    layout = gpt2_layout(job)
    if layout.differences:
        raise UserError(f"export hf: {job.path}: GPT-2 (GPT2Config) cannot express this net: "
                        + "; ".join(layout.differences))
    values = trained_values(layout.graph, job, weights_path)
    check_finite(values, weights_path)
    tensors = {hf: np.ascontiguousarray(values[ours].T if transposed else values[ours])
               for hf, ours, transposed in layout.tensors}
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {out_dir} is a file; export hf writes a folder "
                        f"({WEIGHTS} and config.json)")
    vocabulary = saved_tokenizer(weights_path)  # the run's subword vocabulary, or None: bytes
    if vocabulary is not None:  # a checkpoint of an old data file's JSON: HF would truncate/pad
        from ..data.tokenizer import whole_text_json
        vocabulary = whole_text_json(vocabulary)
    held = [name for name in TOKENIZER_FILES if os.path.lexists(os.path.join(out_dir, name))]
    if vocabulary is None and held:
        # AutoTokenizer.from_pretrained(out_dir) would read another model's
        # vocabulary: tokenizer.json, or a GPT-2 BPE's vocab.json and merges.txt
        raise UserError(f"--out {out_dir} holds {' and '.join(held)} (an earlier export's, "
                        "or a downloaded model's?), but this model is byte-level (its token "
                        "ids are UTF-8 bytes): Hugging Face would load that vocabulary with "
                        f"it; remove {' and '.join(held)} or give another --out. Nothing "
                        "written")
    make_folder(out_dir)
    weights = os.path.join(out_dir, WEIGHTS)
    write_replacing(weights, lambda tmp: st.save_file(tensors, tmp, metadata={"format": "pt"}))
    text = json.dumps(layout.config, indent=2) + "\n"
    write_text_replacing(os.path.join(out_dir, "config.json"), text)
    if vocabulary is not None:  # AutoTokenizer.from_pretrained(out_dir) reads it
        write_text_replacing(os.path.join(out_dir, TOKENIZER), vocabulary)
    c = layout.config
    tokens = (f"; its vocabulary in {TOKENIZER}" if vocabulary is not None else
              "; byte-level: token ids are the text's UTF-8 bytes (no tokenizer file)")
    return (f"{len(tensors)} tensors, GPT-2 of {c['n_layer']} layers, {c['n_head']} heads, "
            f"width {c['n_embd']}, vocabulary {c['vocab_size']}, context {c['n_positions']} "
            f"({c['activation_function']}){tokens}; transformers.GPT2LMHeadModel."
            f"from_pretrained('{out_dir}') loads it")
