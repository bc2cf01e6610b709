"""Checks that a checkpoint is whole and fits the net before anything of it
is used (docs/formats.md, "What a checkpoint must hold").

``check_attrs`` (called by ``load_checkpoint`` on every read) refuses root
attributes of the wrong type or out of range: ``iteration`` a non-negative
integer no larger than the history the file itself records (the
``solver.max_iter`` of the config it was written with, and N for a file
named ``ckpt_<N>.h5``), ``elapsed`` a finite number >= 0, ``run_id`` text,
``world_size`` >= 1 and ``seed`` integers. ``check_for_net`` (``--resume``)
refuses a checkpoint whose parameters or solver state lack a blob of the
net, hold one it does not use, or differ in dtype or shape, and names the
first weight or solver state (``<param>.<state>``) holding NaN or inf;
``unused_note``
is the one-line note ``--init`` and ``test --weights`` print instead.
``check_finite`` names the first blob holding NaN or inf.

Every failure is a UserError naming the file and what is wrong (exit 2),
except non-finite weights: ``NonFiniteWeights``, exit 3 (as a diverged run).
"""
import copy
import functools
import math
import os
import re

import numpy as np

from ..base.backend import all_finite
from ..base.errors import UserError, one_line

_CKPT_NAME = re.compile(r"^ckpt_(\d+)\.h5$")


def _plain(value):
    """Attribute values as plain Python (numpy scalars -> int/float, bytes -> str)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


def plain_attr(value):
    """One attribute's value as plain Python, or None when it is missing."""
    return _plain(value) if value is not None else None



class NonFiniteWeights(UserError):
    """Weights holding NaN or inf: no figure computed from them means anything."""

    exit_code = 3


class Unchecked(Exception):
    """An array dataset read without its Fletcher-32 filter (the dataset's name)."""

    def user_error(self, path):
        return UserError(f"checkpoint '{path}' is invalid: dataset '/{self}' has no Fletcher-32 "
                         "checksum (every array of a checkpoint is written with one); it was "
                         "rewritten by another tool or edited")


def names_the_file(what):
    """Decorate a reader of ``path``: HDF5's own errors on a damaged file
    (heaps, b-trees, object headers: OSError, KeyError, RuntimeError,
    ValueError) become one UserError naming the file."""
    def wrap(read):
        @functools.wraps(read)
        def reader(path, *args, **kw):
            try:
                return read(path, *args, **kw)
            except (OSError, KeyError, RuntimeError, ValueError) as e:
                raise UserError(f"{what} '{path}' is corrupt: {type(e).__name__}: {e}") \
                    from None
        return reader
    return wrap


def check_layout(f, path, checksum):
    """The groups every checkpoint has (``/params``, ``/state``) and the
    digest ``/state`` is verified against (returned)."""
    for section in ("params", "state"):
        if section not in f or not hasattr(f[section], "keys"):
            raise UserError(f"checkpoint '{path}' is invalid: it has no '/{section}' group; it "
                            "was damaged or edited")
    expected = f["state"].attrs.get(checksum)
    expected = expected.decode() if isinstance(expected, bytes) else expected
    if not isinstance(expected, str):
        raise UserError(f"checkpoint '{path}' is invalid: '/state' has no '{checksum}' "
                        "attribute to verify it against; it was damaged or edited")
    return expected


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value):
    return (_is_int(value) or isinstance(value, (float, np.floating))) and \
        not isinstance(value, (bool, np.bool_))


def saved_config(config_text):
    """The config (a dict) a checkpoint was written with, or None when its
    text is absent or not our config's. A resume reads it five times (the
    net's meaning, its changes, the data, max_iter): the text is parsed once
    (a big net's, GoogLeNet's 28 kB, takes about 0.1 s) and each caller gets
    its own copy."""
    if not isinstance(config_text, str) or not config_text.strip():
        return None
    cfg = _parsed_config(config_text)
    return copy.deepcopy(cfg) if cfg is not None else None


@functools.lru_cache(maxsize=4)
def _parsed_config(config_text):
    try:
        from .yamlread import read_yaml  # strict and bounded, as the job file
        cfg = read_yaml(config_text)
    except Exception:  # not our config text
        return None
    return cfg if isinstance(cfg, dict) else None


def changed_data_note(config_text, data, path):
    """A note naming each data split of ``data`` (the job's DataSpecs) whose
    file is not the one the run that wrote checkpoint ``path`` read (its
    saved config holds the absolute path), or None: a resume from another
    folder or host may reach other data under the same relative path."""
    saved = (saved_config(config_text) or {}).get("data")
    if not isinstance(saved, dict):
        return None
    changed = []
    for phase, spec in data.items():
        then = saved.get(phase)
        then = then.get("path") if isinstance(then, dict) else None
        if isinstance(then, str) and spec.path is not None and then != spec.path:
            changed.append(f"data.{phase}.path is {spec.path!r}, the run that wrote it "
                           f"read {then!r}")
    if not changed:
        return None
    return (f"note: resuming from {path}: {'; '.join(changed)} (another file, or the same one "
            "under another path)")


def changed_net_note(config_text, net, path):
    """A note naming how ``net`` (this config's layers) differs from the net
    of the run that wrote checkpoint ``path`` (its saved config): layers
    removed or added, keys of a layer changed, the order; or None. A resume
    with the same parameters but another net (a ReLU gone, max pooling made
    average) would otherwise go on without a word."""
    saved = (saved_config(config_text) or {}).get("net")
    if not isinstance(saved, list) or not net:
        return None
    from ..layers import layer_spec
    then = {e.get("name"): _plain_value(e) for e in saved if isinstance(e, dict)}
    now = {e.get("name"): _plain_value(e) for e in net}
    changes = [f"layer '{n}' removed" for n in then if n not in now]
    changes += [f"layer '{n}' added" for n in now if n not in then]
    for name, entry in now.items():
        old = then.get(name)
        if old is None or old == entry:
            continue
        spec = layer_spec(entry.get("type"))
        keys = {k.name: k for k in spec.all_keys()} if spec is not None else {}
        for key in list(entry) + [k for k in old if k not in entry]:
            a, b = old.get(key), entry.get(key)
            if key in keys:  # an absent key is its default; a pair k is [k, k]
                k = keys[key]
                default = name if k.default == "<name>" else k.default  # top: the name
                a = _key_value(k, default if key not in old else a)
                b = _key_value(k, default if key not in entry else b)
            if key == "type" and spec is not None and spec is layer_spec(a):
                continue  # another spelling of the type (conv, convolution)
            if a != b:
                changes.append(f"layer '{name}' {key} {a!r} -> {b!r}")
    if not changes and [n for n in then] != [n for n in now]:
        changes.append("the layers' order")
    if not changes:
        return None
    more = f" and {len(changes) - 6} more" if len(changes) > 6 else ""
    return (f"note: resuming from {path}: this net differs from the one that wrote it: "
            f"{'; '.join(changes[:6])}{more} (the weights load by name; the run goes on "
            "with this net)")


def _plain_value(value):
    """A config value with its mappings and lists as plain dicts and lists."""
    from collections.abc import Mapping
    if isinstance(value, Mapping):
        return {k: _plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_value(v) for v in value]
    return value


def _max_iter(config_text):
    """solver.max_iter of the config text a checkpoint was written with, or
    None when it does not say."""
    try:
        value = (saved_config(config_text) or {})["solver"]["max_iter"]
    except (KeyError, TypeError):  # no bound from it
        return None
    return int(value) if _is_int(value) and value >= 0 else None


def _key_value(key, value):
    """A layer key's value in one form: a pair ``k`` is ``[k, k]``."""
    if key.kind == "pair" and _is_int(value):
        return [int(value), int(value)]
    return list(value) if isinstance(value, tuple) else value


def check_same_meaning(config_text, net, path, layers=None, what="weights file"):
    """Refuse weights whose config (``config_text``, saved in the file) gives
    a layer of ``net`` (this config's layers; only those named in
    ``layers`` when given: the layers loaded) another type, or another value
    of a key that changes what its weights mean though their shapes stay
    (``Key.weights`` in layers/registry.py: attention's num_heads and
    causal, conv's dilation and group, fc's axis). A file without a config
    (a .caffemodel, another tool's) and the layers it does not name are
    not compared; keys of training (solver, data, dropout) never are."""
    saved = (saved_config(config_text) or {}).get("net")
    if not isinstance(saved, list) or not net:
        return
    from ..layers import layer_spec
    by_name = {entry.get("name"): entry for entry in saved if isinstance(entry, dict)}
    for entry in net:
        name = entry.get("name")
        old = by_name.get(name)
        spec = layer_spec(entry.get("type"))
        if old is None or spec is None or (layers is not None and name not in layers):
            continue
        was = layer_spec(old.get("type"))
        if was is None or was.type != spec.type:
            raise UserError(f"{what} '{path}': layer '{name}' was saved as type "
                            f"{old.get('type')!r}, this config makes it {entry.get('type')!r}; "
                            "its weights would mean something else")
        for key in spec.keys:
            if not key.weights:
                continue
            now = _key_value(key, entry.get(key.name, key.default))
            then = _key_value(key, old.get(key.name, key.default))
            if now != then:
                raise UserError(f"{what} '{path}': layer '{name}' was saved with {key.name} "
                                f"{then!r}, this config gives {key.name} {now!r}; the weights "
                                "have the same shapes but would mean something else (use the "
                                f"value they were trained with)")


def check_attrs(attrs, path):
    """Raise a UserError naming ``path`` if a root attribute a resume relies
    on is missing, of the wrong type or out of range."""
    def bad(message):
        raise UserError(f"checkpoint '{path}' is invalid: {message}; it was damaged or edited "
                        "(resume from another checkpoint, e.g. --resume auto, which skips "
                        "such files)")
    if "iteration" not in attrs:
        bad("it has no root attribute 'iteration'")
    it = attrs["iteration"]
    if not _is_int(it):
        bad(f"root attribute 'iteration' is {it!r}, not an integer")
    if it < 0:
        bad(f"root attribute 'iteration' is {it}, below 0")
    bound = _max_iter(attrs.get("config"))
    if bound is not None and it > bound:
        bad(f"root attribute 'iteration' is {it}, beyond the solver.max_iter {bound} of the "
            "config it was written with")
    m = _CKPT_NAME.match(os.path.basename(str(path)))
    if m and int(m.group(1)) != it:
        bad(f"root attribute 'iteration' is {it}, but the file was written at iteration "
            f"{m.group(1)} (its name)")
    if "elapsed" in attrs:
        e = attrs["elapsed"]
        if not _is_number(e) or not math.isfinite(e) or e < 0:
            bad(f"root attribute 'elapsed' is {e!r}, not a finite number of seconds >= 0")
    if "run_id" in attrs and not isinstance(attrs["run_id"], str):
        bad(f"root attribute 'run_id' is {attrs['run_id']!r}, not text")
    if "world_size" in attrs and (not _is_int(attrs["world_size"]) or attrs["world_size"] < 1):
        bad(f"root attribute 'world_size' is {attrs['world_size']!r}, not an integer >= 1")
    if "seed" in attrs and not _is_int(attrs["seed"]):
        bad(f"root attribute 'seed' is {attrs['seed']!r}, not an integer")


def check_finite(values, path, what="weights file"):
    """Raise NonFiniteWeights naming the first blob of ``values`` ({name:
    array}) that holds NaN or inf."""
    for name, value in values.items():
        arr = np.asarray(value)
        if arr.dtype.kind in "fc" and not all_finite(arr):  # no array-sized temporary
            n = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            raise NonFiniteWeights(
                f"{what} '{path}' holds non-finite values (NaN or inf) in blob '{name}' "
                f"({n} of {arr.size}); no result computed from it would mean anything. Use an "
                "earlier checkpoint (a run that hit NaN keeps its last finite one as latest.h5)")


def unused_blobs(loaded, net_params):
    """The names of ``loaded`` (a file's /params) that the net has no blob for."""
    wanted = set(net_params)
    return sorted(n for n in loaded if n not in wanted)


def unused_note(loaded, net_params, path):
    """One line naming the file's blobs the net does not use, or None."""
    extra = unused_blobs(loaded, net_params)
    if not extra:
        return None
    return (f"note: {path}: {len(extra)} blob(s) of the file are not used by this net: "
            f"{', '.join(map(one_line, extra[:8]))}{' ...' if len(extra) > 8 else ''}")


def check_for_net(ck, path, net_params, blobs, solver_blobs):
    """``--resume`` continues the same net: every parameter of ``net_params``
    (the whole net's names) is in the checkpoint and nothing else is; the
    parameters ``blobs`` ({name: array} of this rank) and solver state
    ``solver_blobs`` ({(param, state): array}) have the dtype and shape the
    graph has; every weight and every solver state resumed is finite."""
    missing = [p for p in net_params if p not in ck.params]
    if missing:
        raise UserError(f"{path}: checkpoint lacks parameter(s) {', '.join(missing[:5])} "
                        "of this net")
    extra = unused_blobs(ck.params, net_params)
    if extra:
        raise UserError(f"{path}: checkpoint holds {len(extra)} parameter(s) this net does not "
                        f"have: {', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}; "
                        "--resume continues the same net (to start a changed net from these "
                        "weights, use --init)")
    pairs = [(f"/params/{p}", ck.params[p], arr) for p, arr in blobs.items()]
    pairs += [(f"/solver/{p}/{s}", ck.solver[p][s], arr) for (p, s), arr in solver_blobs.items()
              if s in ck.solver.get(p, {})]
    for where, value, arr in pairs:
        value = np.asarray(value) if not hasattr(value, "__cuda_array_interface__") else value
        if value.dtype != arr.dtype or tuple(value.shape) != tuple(arr.shape):
            raise UserError(f"checkpoint '{path}': '{where}' is {value.dtype} "
                            f"{list(value.shape)}, the net's blob is {arr.dtype} "
                            f"{list(arr.shape)}")
    check_finite({p: ck.params[p] for p in blobs}, path, "checkpoint")
    # the solver state resumed (momentum, Adam's moments) as the weights: a
    # NaN there turns the weights NaN at the first update
    check_finite({f"{p}.{s}": ck.solver[p][s] for (p, s) in solver_blobs
                  if s in ck.solver.get(p, {})}, path, "checkpoint")


def token_params(job):
    """The parameters of ``job``'s net whose rows stand for token ids: the
    tables of its embedding layers and the weight and bias of an fc layer
    whose output a softmax_loss or accuracy scores (a tied lm_head's weight
    is the embedding's table). From the config, so every rank of any scheme
    finds the same set (a pipeline stage may hold neither)."""
    from ..layers import layer_spec

    def kind(layer):
        spec = layer_spec(layer.get("type"))
        return spec.type if spec is not None else None

    def names(value):
        return [value] if isinstance(value, str) else list(value or ())
    net = list(getattr(job, "net", None) or ())
    producer = {top: layer for layer in net for top in names(layer.get("top"))}
    found = set()
    for layer in net:
        if kind(layer) == "embedding":
            found.add(f"{layer.get('name')}/weight")
        elif kind(layer) in ("softmax_loss", "accuracy") and names(layer.get("bottom")):
            scores = producer.get(names(layer.get("bottom"))[0])
            if scores is not None and kind(scores) == "fc":
                found.update(f"{scores.get('name')}/{blob}" for blob in ("weight", "bias"))
    return found


def vocabulary_mismatch(path, vocabulary, job):
    """None when the weights file ``path`` was trained on the token ids of
    ``vocabulary`` (the job's text data's JSON, None: bytes), or when that
    cannot be told (no text data in the job, a file ``train`` did not
    write, a run on other data); else the words naming both. A text run's
    checkpoint holds its subword vocabulary as ``/tokenizer`` (since subword
    data existed), so one without it was trained on bytes."""
    import h5py
    from ..data.tokenizer import DATASET, read_json, vocabulary_digest
    data = getattr(job, "data", None)
    if not any(spec is not None and spec.source == "text"
               for spec in (getattr(data, "train", None), getattr(data, "test", None))):
        return None
    try:
        with h5py.File(path, "r") as f:
            fmt, config = (plain_attr(f.attrs.get(k)) for k in ("format", "config"))
            theirs = read_json(f) if isinstance(f.get(DATASET), h5py.Dataset) else None
    except (OSError, KeyError, ValueError, TypeError):
        return None
    if fmt != "purine_mpi.checkpoint":
        return None
    saved = (saved_config(config) or {}).get("data")
    if theirs is None and not (isinstance(saved, dict) and any(
            isinstance(s, dict) and s.get("source") == "text" for s in saved.values())):
        return None
    mine = None if vocabulary is None else vocabulary_digest(vocabulary)
    theirs = None if theirs is None else vocabulary_digest(theirs)
    if mine == theirs:
        return None

    def say(d):
        return "bytes (the 256 byte values)" if d is None else f"vocabulary {d[:12]}"
    return (f"weights file '{path}' was trained on the token ids of {say(theirs)}"
            f"{'' if theirs is None else ' (its /tokenizer)'}, but this job's text data "
            f"holds those of {say(mine)}")


def check_same_vocabulary(path, vocabulary, job, params, resume=False):
    """A UserError when ``params`` (the whole net's parameters taken from
    weights file ``path``, on every rank the same) include ones whose rows stand for token ids (``token_params``)
    and the file was trained on another vocabulary than the job's text
    data (``vocabulary_mismatch``): id i would read the row of another
    token, and a test loss, a resumed run or a fine-tune would be computed
    on scrambled tokens without a word. ``resume``: every parameter counts."""
    hit = sorted(set(params) & token_params(job)) if not resume else sorted(params)
    if not hit:
        return
    words = vocabulary_mismatch(path, vocabulary, job)
    if words is None:
        return
    if resume:
        raise UserError(f"{words}: a resumed run would read each id as another token; "
                        "resume with data made with the tokenizer it was trained with")
    layers = sorted({p.rsplit("/", 1)[0] for p in hit})
    raise UserError(f"{words}: the rows of {', '.join(hit)} would stand for other tokens; "
                    "use data made with the tokenizer it was trained with, or, to fine-tune "
                    f"on this vocabulary, start those layers afresh (train --init-skip "
                    f"{','.join(layers)})")
