"""Config YAML: loading, ``--set`` overrides, validation and defaults.

``load_config(path)`` returns the *resolved* config: every section present,
every default filled in, data paths resolved, plus ``config["_path"]`` (the
file it came from); ``load_job`` returns it as a frozen ``Job`` (job/job.py),
which is what the package outside ``job/`` and ``data/`` reads. Every problem is a
``ConfigError(path, key, message)`` naming the file, the dotted key and
what was expected; ``load_config``/``load_job`` (and the CLI, for an error
found later: ``blame_override``) add the line where the key is written,
from the table yamlread.read_yaml_lines keeps beside the parsed values
(``locate``), e.g.::

    jobs/lenet.yaml:17: key 'solver.base_lr': expected a positive number, got 'abc'

Every key is declared once in job/schema.py (``ConfigKey``: name, checker,
default, meaning): the top-level keys (TOP), the sections (SOLVER,
PARALLEL, CHECKPOINT) and the data specs (DATA), with the choices and their
meanings. This module checks a config against them (and the rules between
keys); the layers' keys are declared in purine_mpi/layers. docs/config.md
is generated from the declarations (re-exported here).

To add a key, add its ``ConfigKey`` to its section's table in
job/schema.py; unknown keys are errors (with a "did you mean" suggestion) so
that typos never pass silently. AFTER CHANGING KEYS RUN
``python -m purine_mpi.tools.docgen --write`` (tests/test_docs.py fails while
docs/config.md is stale or a key has no meaning).
"""
import copy
import os
import re

import yaml

from ..base.errors import ConfigError, excerpt, one_line
from .checks import _check_int, _check_keys, _is_int, _kind
from .data_spec import _check_data
from .job import Job, job_of
from .keys import check_section
from .repeat import expand_net
from .yamlread import YamlRefused, read_yaml, read_yaml_lines, where
from .schema import (AUTO_SCHEME, RESOLVED_FIRST, SECTION_KEYS, SHARD_STAGES, SOLVER, TOP,
                     TOP_KEYS)
from ..layers import check_layer, layer_key, layer_spec
from ..ops.batchnorm import REPLICA_SUM


# ------------------------------------------------------------------ loading
def load_config(path, overrides=(), iters=None, check_files=True):
    """Read, override, validate and resolve the config at ``path``.

    ``overrides``: ``"dotted.key=value"`` strings (``--set``); the value is
    parsed as YAML (``0.05``, ``true``, ``[1, 8, 8]``); integer parts index
    lists (``net.0.num_output=8``). ``iters`` overrides ``solver.max_iter``.
    ``check_files``: check at load time that HDF5 data files exist.
    """
    return _load(resolve_config, path, overrides, iters, check_files)


def load_job(path, overrides=(), iters=None, check_files=True):
    """``load_config`` as a frozen, typed ``Job`` (job/job.py): what the commands run."""
    return _load(resolve_job, path, overrides, iters, check_files)


def _load(resolve, path, *args):
    """``resolve`` (resolve_config or resolve_job) of the file at ``path``;
    a ConfigError naming a key of the file names its line too (``locate``)."""
    raw, lines = _read_lines(path)
    try:
        return resolve(raw, str(path), *args)
    except ConfigError as exc:
        located = locate(exc, str(path), lines)
        if located is exc:
            raise
        raise located from None


def locate(exc, path, lines):
    """``exc`` (a ConfigError naming the file ``path``'s key) with the line
    where that key is written (or, for a key the file lacks, its nearest
    parent: ``solver`` for a missing ``solver.stepsize``), from ``lines``
    (``_read_lines``'s table); ``exc`` as it is for another file, a
    ``--set`` it names, a key the file holds no part of (a missing
    top-level key) or an error that has its line."""
    if not isinstance(exc, ConfigError) or exc.line or not exc.key or not lines \
            or str(exc.path) != str(path):
        return exc
    line = key_line(exc.key, lines)
    return exc.at_line(line) if line else exc


def key_line(key, lines):
    """The line of the config key ``key`` (as an error names it:
    ``solver.base_lr``, ``net[2].stride``, ``net.3.block.0.name``) or of its
    nearest parent in ``lines`` (yamlread.read_yaml_lines' table); None
    when not even its first part is there. A key of the file may hold a dot
    (``solver.a.b`` is the key ``a.b`` of ``solver`` when the file has no
    ``a``), and a path through an alias's later use reads on at its
    anchor's value (``lines.aliases``): the line where that text is."""
    parts = [p.strip() for p in re.sub(r"\[(-?\d+)\]", r".\1", str(key)).split(".")]
    aliases = getattr(lines, "aliases", {})
    path, line = (), None
    while parts:
        for n in range(len(parts), 0, -1):  # the longest step the file has: 'a.b' before 'a'
            step = path + (".".join(parts[:n]),)
            if step in lines:
                path, line, parts = step, lines[step], parts[n:]
                break
        else:
            return line
        path = aliases.get(path, path)  # what an alias holds: read on at its anchor
    return line


def resolve_job(raw, path="<config>", overrides=(), iters=None, check_files=True):
    """``resolve_config`` as a ``Job``: the one place a config becomes a job
    (the CLI, the converters, the tests' ``make_job``); it keeps the
    ``overrides`` (``Job.overrides``: what a start-up note names)."""
    resolved, given = _resolve(raw, path, overrides, iters, check_files)
    job = job_of(resolved)
    sets = tuple(str(text) for text in overrides or ())
    ignored = _ignored_data_keys(given, raw, sets, job)  # the --set applied once, above
    if not sets and not ignored:
        return job
    return job.replace(overrides=sets or None, ignored_data_keys=ignored or None)


def _ignored_data_keys(config, raw, overrides, job):
    """(phase, key, value, the ``--set`` that wrote it or None) of each key
    of a data spec the validated spec left out: a key of another source
    (``shape``, ``classes``, ``num_samples`` on an hdf5 spec, after ``--set
    data.train.source=hdf5``; ``in_memory`` on a synthetic one), accepted
    (switching the source by ``--set`` keeps the other source's keys) but
    read by nothing (data_spec.data_notes says so). A synthetic spec's
    ``path`` has its own note. ``config``: the config the job was resolved
    from, its ``--set`` values applied (once, by ``_resolve``); ``raw``: the
    file's, for naming the ``--set`` that wrote a key."""
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    out = []
    for phase, spec in job.data.items():
        given = data.get(phase)
        if not isinstance(given, dict):
            continue
        kept = spec.to_config()
        for key, value in given.items():
            if value is None or key in kept or (key == "path" and spec.source == "synthetic"):
                continue
            out.append((phase, key, value, _override_at(f"data.{phase}.{key}", overrides, raw)))
    return tuple(out)


def load_job_of_checkpoint(path, overrides=(), check_files=False):
    """The job of the resolved config a checkpoint holds (its root attribute
    ``config``, docs/formats.md): ``generate --weights CKPT`` without a
    config. Errors name it as ``CKPT (its config)``."""
    from .checkpoint_file import open_h5, plain_attr
    path = str(path)
    with open_h5(path, "weights file") as f:
        text = plain_attr(f.attrs.get("config"))
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(path, None, "the file holds no config (root attribute 'config'): it "
                          "is not a checkpoint train wrote; give the config too (CONFIG "
                          f"--weights {path})")
    name = f"{path} (its config)"
    return resolve_job(_parse(text, name), name, overrides, None, check_files)


def _read_lines(path):
    """(the parsed YAML of the config file at ``path``, the line of each of
    its keys: yamlread.read_yaml_lines' table, shared: not to be changed)."""
    path = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(path, None, "config file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(path, None, f"not a YAML text file: byte {e.start} is not UTF-8 "
                                      "(a binary file given as the config?)") from None
    except OSError as e:
        raise ConfigError(path, None, f"cannot read the config file: {e.strerror or e}") from None
    _READ.pop(path, None)   # first: a file read again is no other file's room
    while len(_READ) >= 8:
        del _READ[next(iter(_READ))]
    _READ[path] = text
    return _parse_lines(text, path)


#: path -> the text last read from it, of the last few config files read:
#: ``blame_override`` places an error found later in the text the job was
#: loaded from, not in the file as it is now (edited since, or a pipe,
#: ``<(...)`` or ``/dev/stdin``, that a second read finds empty)
_READ = {}


#: (text, path) -> its parsed YAML, of the last few configs read: ``plan
#: --choose`` loads the job once per candidate setting, and the YAML reader
#: took 5-9% of its time; each caller gets its own deep copy
_PARSED = {}


def _parse(text, path):
    """The parsed YAML of config ``text`` (read from ``path``)."""
    return _parse_lines(text, path)[0]


def _parse_lines(text, path):
    """``_parse`` and the line of each key (``_read_lines``)."""
    if (text, path) not in _PARSED:
        parsed = _parse_text(text, path)
        while len(_PARSED) >= 8:
            del _PARSED[next(iter(_PARSED))]
        _PARSED[(text, path)] = parsed
    raw, lines = _PARSED[(text, path)]
    return copy.deepcopy(raw), lines


def _parse_text(text, path):
    """``_parse_lines``, read."""
    try:
        raw, lines = read_yaml_lines(text, path)  # strict and bounded: job/yamlread.py
    except YamlRefused as e:
        raise ConfigError(path, None, e.problem) from None
    except yaml.YAMLError as e:
        raise ConfigError(path, None, f"malformed YAML at {where(e)}") from None
    if raw is None:
        raise ConfigError(path, None, "the config file is empty")
    return raw, lines


def resolve_config(raw, path="<config>", overrides=(), iters=None, check_files=True,
                   blame=True):
    """``load_config`` for an already-parsed mapping (tests, benchmarks).
    ``blame``: a refusal a ``--set`` caused names it (``_blamed_override``)."""
    return _resolve(raw, path, overrides, iters, check_files, blame)[0]


def _resolve(raw, path="<config>", overrides=(), iters=None, check_files=True, blame=True):
    """``resolve_config``: (the resolved config, the config it was resolved
    from: ``raw`` with the ``--set`` values and ``--iters`` applied)."""
    if not isinstance(raw, dict):
        raise ConfigError(path, None, "expected a mapping of top-level keys "
                                      f"({', '.join(TOP_KEYS)}), got {_kind(raw)}")
    config = copy.deepcopy(raw)
    for text in overrides or ():
        try:
            apply_override(config, text, path)
        except ConfigError as exc:  # the --set's own fault: name it, not the file (nor a line)
            raise ConfigError(f"--set {excerpt(text, quote=False)}", exc.key, exc.problem,
                              exc.also) from None
    if iters is not None:
        config.setdefault("solver", {})
        if not isinstance(config["solver"], dict):
            raise ConfigError(path, "solver", f"expected a mapping, got {_kind(config['solver'])}")
        config["solver"]["max_iter"] = _check_int("--iters", iters, path, minimum=0)
    try:
        return validate_config(config, path, check_files), config
    except ConfigError as exc:
        if not blame:
            raise

        def without(rest):  # the refusal the config gives with only ``rest`` (or None)
            try:
                resolve_config(raw, path, rest, iters, check_files=False, blame=False)
            except ConfigError as again:
                return again
            return None
        source = _blamed_override(exc, overrides, raw, without)
        if source is None:
            # the file's fault, found with the test ``without`` makes: a later
            # look at the error (the CLI's blame_override, which cannot
            # resolve the config again) takes this verdict, not its own
            exc.file_at_fault = True
            raise
        raise ConfigError(f"--set {excerpt(source, quote=False)}", exc.key, exc.problem,
                          exc.also) from None


def blame_override(exc, path, overrides):
    """``exc`` (an error found after the config was resolved: building the
    graph, reading the data) naming the ``--set`` that wrote its key where
    one did, as ``resolve_config`` names it for the checks of the config
    itself: ``--set data.train=null`` or ``--set net=[]`` made errors that
    named the file, which holds neither; else with the line of the file
    where its key is written (``locate``), as for an error the loader found
    the file's own (``file_at_fault``: refused alike without the --set).
    ``exc`` as it is otherwise."""
    if not isinstance(exc, ConfigError) or path is None or str(exc.path) != str(path):
        return exc
    try:
        text = _READ.get(str(path))
        raw, lines = _read_lines(path) if text is None else _parse_lines(text, str(path))
    except ConfigError:
        return exc
    source = _blamed_override(exc, overrides, raw) \
        if overrides and not getattr(exc, "file_at_fault", False) else None
    if source is None:
        return locate(exc, path, lines)
    return ConfigError(f"--set {excerpt(source, quote=False)}", exc.key, exc.problem, exc.also)


def _blamed_override(exc, overrides, raw, without=None):
    """The ``--set`` text a ConfigError is to name: the one that wrote its
    key, else (a rule between keys: ``exc.also``, the other keys it read)
    the last one on the command line that wrote one of those: ``--set
    solver.base_lr=1e-4`` under the file's cosine ``min_lr: 0.001`` made
    the refusal of min_lr, which the file holds as it always did. None when
    the file is at fault: also where the config without those ``--set``
    (``without(rest)``: its refusal, or None) is refused on the same key
    (the file's ``min_lr: 0.5`` above its ``base_lr: 0.05``, under ``--set
    solver.base_lr=0.1``: the file's pair was refused before the --set)."""
    source = _override_at(exc.key, overrides, raw)
    if source is not None and without is not None and _in_list_at(exc.key, source, raw):
        again = without([text for text in overrides if text != source])
        if again is not None and again.key == exc.key:
            return None  # the file's own entries of that list are refused without it
    if source is not None or not getattr(exc, "also", ()):
        return source
    found = {_override_at(key, overrides, raw) for key in exc.also} - {None}
    found |= {text for key in exc.also for text in _overrides_under(key, overrides)}
    if found and without is not None:
        again = without([text for text in overrides if text not in found])
        if again is not None and again.key == exc.key:
            return None
    for text in reversed(list(overrides or ())):
        if text in found:
            return text
    return None


def _override_at(key, overrides, raw):
    """The last ``--set`` text that wrote the config key ``key`` (as an error
    names it: ``solver.base_lr``, ``net[2].stride``) or the mapping that holds
    it, where the file has no such mapping; None when the file is at fault."""
    if not key:
        return None
    parts = re.sub(r"\[(\d+)\]", r".\1", str(key)).split(".")
    for text in reversed(list(overrides or ())):
        set_parts = _set_key_parts(text, raw)
        if parts[:len(set_parts)] == set_parts:  # in the value --set gave
            return text
        if set_parts[:len(parts)] == parts and not _has_path(raw, parts):
            return text  # a mapping --set made for its key (a mistyped section)
        if _in_list_at(key, text, raw):
            return text  # an entry of the file's list judged whole (net.9.bottom.1)
    return None


def _in_list_at(key, text, raw):
    """Whether the ``--set`` ``text`` replaced an entry of the list of
    plain values the file holds at the config key ``key`` (``--set
    net.9.bottom.1=x`` and an error on ``net[9].bottom``, a list judged
    whole): a check of that list reads the value the --set gave. Before, the
    refusal named the file's line of the list, which holds the entry the
    --set replaced. Not a list of mappings (``net``: a --set of one layer's
    key is not what a rule of the whole net, a missing loss, is about)."""
    parts = re.sub(r"\[(\d+)\]", r".\1", str(key)).split(".")
    set_parts = _set_key_parts(text, raw)
    if len(set_parts) != len(parts) + 1 or set_parts[:len(parts)] != parts:
        return False
    node = raw
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return isinstance(node, list) and not any(isinstance(v, (dict, list)) for v in node)


def _set_key_parts(text, raw):
    """The dotted key of the ``--set`` ``text`` as its parts, a negative
    list index (``net.-1``, the file's last entry, as ``apply_override``
    takes it) counted from the start of the file's list (``net.10``), as an
    error names that key: ``--set net.-1.num_output=3`` was not found to
    have written ``net[10].num_output``, and its refusal named the file's
    line of that layer, which holds no num_output."""
    parts, node = [p.strip() for p in str(text).partition("=")[0].strip().split(".")], raw
    for i, part in enumerate(parts):
        if isinstance(node, list) and part.lstrip("-").isdigit() \
                and -len(node) <= int(part) < len(node):
            parts[i] = str(int(part) % len(node))
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            break
    return parts


def _overrides_under(key, overrides):
    """The ``--set`` texts that wrote a key inside the config key ``key``
    (``net.3.name`` inside ``net``): what a rule that read ``key`` read."""
    parts = re.sub(r"\[(\d+)\]", r".\1", str(key)).split(".")
    return [text for text in overrides or ()
            if [p.strip() for p in str(text).partition("=")[0].strip().split(".")][
                :len(parts)] == parts]


def _has_path(raw, parts):
    """Whether the parsed file ``raw`` holds the dotted path ``parts``."""
    node = raw
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.lstrip("-").isdigit() \
                and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def apply_override(config, text, path="<config>"):
    """Apply one ``KEY=VALUE`` override in place (creating missing mappings)."""
    key, sep, value_text = str(text).partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p.strip() for p in parts):
        raise ConfigError(path, None, f"bad --set override {excerpt(text)}: expected KEY=VALUE "
                                      "with a dotted key, e.g. solver.base_lr=0.05 or net.0.num_output=8")
    try:
        value = read_yaml(value_text) if value_text.strip() else ""
    except YamlRefused as e:
        raise ConfigError(path, key, f"bad --set override {excerpt(text)}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(path, key, f"bad --set override {excerpt(text)}: the value is not "
                                     f"valid YAML ({where(e)})") from None
    node = config
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        here = ".".join(parts[:depth]) or "the top level"
        if isinstance(node, list):
            if not part.lstrip("-").isdigit():
                raise ConfigError(path, key, f"bad --set override {excerpt(text)}: {here} is a "
                                             f"list, index it with an integer, not {excerpt(part)}")
            index = int(part)
            if not -len(node) <= index < len(node):
                raise ConfigError(path, key, f"bad --set override {excerpt(text)}: index "
                                             f"{index} is out of range ({here} has {len(node)} entries)")
            if last:
                node[index] = value
            node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(path, key, f"bad --set override {excerpt(text)}: {here} is "
                                         f"{_kind(node)}, it has no key {excerpt(part)}")
    return config


def dump_config(config):
    """YAML text of a resolved config (or of a ``Job``), without private
    (``_``-prefixed) keys."""
    if isinstance(config, Job):
        config = config.to_config()
    public = {k: v for k, v in config.items() if not str(k).startswith("_")}
    return yaml.dump(public, Dumper=_DUMPER, sort_keys=False, default_flow_style=None, width=100)


#: libyaml's emitter where PyYAML has it (the same text, ~4x faster: a run
#: writes its config three times at start-up), else PyYAML's own
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


# --------------------------------------------------------------- validation
def validate_config(config, path="<config>", check_files=True):
    """Check every section of a parsed config and fill in defaults: the
    declared keys of job/schema.py's TOP in order (``name``, ``seed``
    first), then the rules between keys."""
    _check_keys("", config, TOP_KEYS, path)
    from_file = path and not str(path).startswith("<")
    stem = os.path.splitext(os.path.basename(path))[0] if from_file else "net"
    keys = {key.name: key for key in TOP}
    out = {}
    for name in RESOLVED_FIRST + tuple(k for k in TOP_KEYS if k not in RESOLVED_FIRST):
        key = keys[name]
        value = config.get(name, stem if name == "name" else key.default)
        if name == "net" and value is None and config.get("graph") is None:
            raise ConfigError(path, "net", "the config defines no network: give 'net' (a "
                                           "list of layers) or 'graph' (a list of blobs and ops)")
        if value is None and key.default is None:
            continue  # net or graph not given, backend auto
        if name == "data":
            out[name] = _check_data(value, path, check_files)
        elif name == "net":
            out[name], net_keys = _check_net(value, path)
            if any(".block." in k for k in net_keys):  # a repeat: the file's key of each layer
                out["_net_keys"] = net_keys  # (the rules name a layer by it)
        elif name in _STRUCTURE:
            out[name] = _STRUCTURE[name](value, path)
        elif name in SECTION_KEYS:
            out[name] = check_section(name, value, SECTION_KEYS[name], path)
            _SECTION_RULES.get(name, lambda *a: None)(out, config.get(name), path)
            if name == "solver":  # before the parallel rules read it (clip_gradients)
                _graph_solver_rules(out, config.get("solver"), path)
        else:
            out[name] = key.check(name, value, path)
    _recompute_rules(out, path)
    _precision_rules(out, config, path)
    _watch_rules(out, path)
    net_keys = out.pop("_net_keys", None)
    out["_path"] = path
    if net_keys:
        out["_net_keys"] = net_keys  # after _path, as Job.to_config writes them
    if _is_int(out["parallel"]["stages"]):
        # parallel.stages: S, cut by the layers' FLOPs into the map every consumer reads
        from .stage_cut import flop_stages
        out["parallel"]["stages"] = flop_stages(out)
        _check_pipeline(out, path)
    return out


#: the LearningRate attrs each lr_policy reads (ops/lr_policy.learning_rate), with warm-up's
_POLICY_KEYS = {"fixed": (), "step": ("gamma", "stepsize"), "multistep": ("gamma", "stepvalues"),
                "exp": ("gamma",), "inv": ("gamma", "power"), "sigmoid": ("gamma", "stepsize"),
                "poly": ("max_iter", "power"), "cosine": ("max_iter", "min_lr")}
#: the defaults learning_rate takes for an attr a LearningRate op leaves out
_LR_DEFAULTS = {"lr_policy": "fixed", "min_lr": 0.0, "warmup_iters": 0,
                "warmup_start_factor": 0.0}


def _graph_solver_rules(out, given, path):
    """A complete ``graph:`` (its own update ops, as ``graph --format yaml``
    writes it) runs its own LearningRate and update ops, whatever the
    solver section says: ``--iters 20`` left a cosine op's ``max_iter: 10``
    (the rate 0 from iteration 10 on), ``--set solver.base_lr=0.5`` and the
    start-up block said 0.5 while the op trained at its own. So a solver
    key the config gives (the file, ``--set``, ``--iters``) that an op reads
    must equal the op's attr (a ConfigError naming both, and the op's key to
    set), and a key it does not give is the op's (the start-up block, the
    rows and the saved config say what runs)."""
    graph = out.get("graph")
    if not graph:
        return
    from ..graph.solver_graph import UPDATE_KEYS
    from ..ops.updates import SOLVER_UPDATES
    kinds = {op_type: kind for kind, (op_type, _) in SOLVER_UPDATES.items()}
    ops = [(i, e) for i, e in enumerate(graph) if isinstance(e, dict) and e.get("type") == "op"]
    updates = [(i, e) for i, e in ops if e.get("op_type") in kinds]
    if not updates:  # a forward-only graph: the solver section makes its solver ops
        return
    given = given if isinstance(given, dict) else {}
    solver = out["solver"]

    def agree(key, value, i, e, why, attr=None):
        if key not in solver:  # an op's attr the config has no key for
            return
        have = solver.get(key)
        same = have == value or (_number(have) and _number(value)
                                 and float(have) == float(value))
        if key not in given:
            solver[key] = value
        elif not same:
            raise ConfigError(path, f"solver.{key}",
                              f"{have!r} (given, or by --set / --iters) is not the "
                              f"{key} {value!r} of the graph's {e.get('op_type')} op "
                              f"'{e.get('name')}' (graph.{i}.attrs.{attr or key}), which "
                              f"{why}: a complete graph runs its own solver ops, whatever the "
                              "solver section says; give both the same value (--set "
                              f"graph.{i}.attrs.{attr or key}=...), or write the graph again "
                              "with graph --format yaml", also=(f"graph.{i}.attrs.{attr or key}",))

    first_i, first = updates[0]
    kind = kinds[first["op_type"]]
    agree("type", kind, first_i, first, "makes every update")
    attrs = first.get("attrs") or {}
    for key in UPDATE_KEYS[kind]:
        if key in attrs:
            agree(key, attrs[key], first_i, first, "the updates apply")
    # a graph that clips its gradients (graph --format yaml of a job with
    # clip_gradients): its clip ops are its solver.clip_gradients, which the
    # composition applies after the gradients' reduction, as a net's
    # (replica.graph_from_seed takes them out: graph/clip.remove_clip)
    clips = [(i, e) for i, e in ops if e.get("op_type") == "ClipScale"]
    if clips:
        i, e = clips[0]
        agree("clip_gradients", (e.get("attrs") or {}).get("clip"), i, e,
              "clips the gradients", "clip")
    for i, e in ops:
        if e.get("op_type") != "LearningRate":
            continue
        attrs = dict(_LR_DEFAULTS, **(e.get("attrs") or {}))
        policy = attrs["lr_policy"]
        keys = ("base_lr", "lr_policy", "warmup_iters") + _POLICY_KEYS.get(policy, ()) + \
            (("warmup_start_factor",) if _number(attrs["warmup_iters"])
             and attrs["warmup_iters"] > 0 else ())
        for key in keys:
            if key in attrs:
                agree(key, attrs[key], i, e, f"gives the rate ({policy} policy)")


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _recompute_rules(out, path):
    """``recompute`` with what it cannot rewrite (graph/recompute.py runs
    on one replica's graph before the composition; the staged and tensor
    compositions, which cut or split that graph, are not built for its
    copies: sharded with stages is one), and ``recompute_layers`` patterns
    that match no layer. Micro-batches are accepted: their composition
    (parallel/micro_batch.py) copies the rewritten graph, the recompute
    copies with it, and each copy's replays read its own packed masks or
    draw its own Philox stream (attr ``stream``, ``<op>@mb<k>``)."""
    mode, patterns = out.get("recompute", "none"), out.get("recompute_layers")
    if mode == "none":
        return
    if out.get("net") is None:
        raise ConfigError(path, "recompute", f"recompute: {mode} needs a 'net' (its layers), "
                          "not a 'graph'", also=("graph", "net"))
    par = out.get("parallel", {})
    stages = par.get("stages")
    # sharded with stages is a pipeline (or hybrid) whose stages' replicas
    # shard: the copies' control edges would cross the stages' ranks
    staged = stages > 1 if _is_int(stages) else len(set((stages or {}).values())) > 1
    if par.get("scheme") in ("pipeline", "hybrid", "tensor") or (
            par.get("scheme") == "sharded" and (par.get("tensor_parallel", 1) > 1 or staged)):
        with_tensor = "" if par["scheme"] != "sharded" else \
            " with parallel.tensor_parallel" if par.get("tensor_parallel", 1) > 1 else \
            " with parallel.stages"
        raise ConfigError(path, "recompute", f"recompute: {mode} does not combine with "
                          f"parallel.scheme: {par['scheme']}{with_tensor}; use recompute: none, "
                          "or scheme: data, or sharded without parallel.stages or "
                          "parallel.tensor_parallel (parallel.micro_batches combine with "
                          "recompute there)",
                          also=("parallel.scheme", "parallel.tensor_parallel", "parallel.stages"))
    import fnmatch
    names = [layer["name"] for layer in out["net"]]
    for p in patterns or ():
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise ConfigError(path, "recompute_layers", f"pattern {excerpt(p)} matches no "
                              "layer of the net", also=("net",))


#: the schemes fp16's loss scaling is built for (graph/loss_scale.py)
FP16_SCHEMES = ("data", "none")


def _precision_rules(out, given, path):
    """``precision`` against ``tf32`` (the older key: ``tf32: true`` means
    ``precision: tf32``), the device (bf16 and fp16 are GPU settings) and
    ``parallel.grad_dtype``. Resolved, ``tf32`` says whether the precision
    is tf32."""
    tf32, precision = given.get("tf32"), given.get("precision")
    if tf32 is not None and precision is not None and bool(tf32) != (precision == "tf32"):
        raise ConfigError(path, "precision", f"precision: {precision} contradicts tf32: "
                          f"{str(bool(tf32)).lower()}; give one of the two keys (precision "
                          "takes tf32 over: precision: tf32 is tf32: true)", also=("tf32",))
    if precision is None and out["tf32"]:
        out["precision"] = "tf32"
    out["tf32"] = out["precision"] == "tf32"
    if out["precision"] in ("bf16", "fp16") and out.get("device", -1) < 0 and \
            out.get("backend") != "cupy":
        raise ConfigError(path, "precision", f"precision: {out['precision']} is a GPU setting "
                          "(the GEMMs of a GPU's tensor cores); the CPU computes in fp32: set "
                          "device: 0 (a GPU) or precision: fp32", also=("device", "backend"))
    par = out["parallel"]
    if out["precision"] == "fp16" and (par["scheme"] not in FP16_SCHEMES or par["mode"] != "sync"):
        raise ConfigError(path, "precision", f"precision: fp16 scales the loss dynamically, "
                          f"which is built for parallel.scheme {' or '.join(FP16_SCHEMES)} with "
                          f"mode sync, not scheme {par['scheme']} with mode {par['mode']}; use "
                          "precision: bf16 (float32's range, no scaling needed)",
                          also=("parallel.scheme", "parallel.mode"))
    _grad_dtype_rules(out, path)


#: the schemes whose gradient buckets may be reduced in bfloat16 (mode sync):
#: data's allreduce, hybrid's allreduce of each stage over its replicas,
#: tensor's allreduce of each tensor shard over its replicas (the tensor
#: groups' allreduces of activations stay float32), sharded's reduce-scatter
#: (with parallel.stages; with parallel.tensor_parallel)
GRAD_DTYPE_SCHEMES = ("data", "hybrid", "tensor", "sharded")
#: the schemes that reduce no gradients: grad_dtype has no effect there, as
#: the start-up notes say (Scheme.settings_without_effect)
GRAD_DTYPE_NO_EFFECT = ("pipeline", "none")
#: the schemes whose buckets are reduced on MPI only (over rank groups: NCCL
#: takes no group), so in bfloat16 on the CPU only
GRAD_DTYPE_MPI_ONLY = ("hybrid", "tensor")


def _grad_dtype_rules(out, path):
    """``parallel.grad_dtype: bf16`` reduces the buckets of the
    ``GRAD_DTYPE_SCHEMES`` (mode sync) through MPI's two-sided collectives
    on the CPU or NCCL on GPUs (parallel/nccl_backend.py checks backend
    auto's choice); under ``GRAD_DTYPE_NO_EFFECT`` it is accepted and noted
    as having no effect."""
    par = out["parallel"]
    if par["grad_dtype"] == "fp32":
        return
    gpu = out.get("device", -1) >= 0 or out.get("backend") == "cupy"
    scheme = par["scheme"]
    # (key, refused, in words, the other keys the refusal read)
    refused = [("parallel.scheme", scheme not in GRAD_DTYPE_SCHEMES + GRAD_DTYPE_NO_EFFECT,
                f"scheme {scheme}", ()),
               ("parallel.mode", par["mode"] != "sync",
                f"mode {par['mode']} (parameter servers)", ()),
               # hybrid's and pipeline's windows carry activations, not the buckets
               # (sharded with stages too: its windows carry the stage transfers)
               ("parallel.transport", par["transport"] == "one_sided" and
                (scheme == "data" or scheme == "sharded" and not par["stages"]),
                "transport one_sided (its windows sum float32)",
                ("parallel.scheme", "parallel.stages")),
               ("parallel.scheme", gpu and scheme in GRAD_DTYPE_MPI_ONLY, f"scheme {scheme} "
                "on a GPU (its buckets are reduced over rank groups on MPI, whose host staging "
                "moves float32; NCCL reduces those of schemes data and sharded)",
                ("device", "backend")),
               ("parallel.backend", gpu and par["backend"] == "mpi",
                "backend mpi on a GPU (its host staging moves float32; use backend nccl)",
                ("device", "backend"))]
    for key, bad, what, also in refused:
        also = ("parallel.grad_dtype",) + also
        if bad:
            raise ConfigError(path, key, f"grad_dtype: {par['grad_dtype']} with {what} is "
                              f"refused: the gradient buckets are reduced in bfloat16 by "
                              f"scheme {', '.join(GRAD_DTYPE_SCHEMES)} (mode sync), through "
                              "MPI's two-sided collectives on the CPU or NCCL on GPUs; use "
                              "grad_dtype: fp32", also=also)


def _check_net(net, path):
    """(the net's layers, its ``repeat`` entries expanded (job/repeat.py),
    the file's key of each); an error names the entry of the file
    (``net.3.block.2.name``)."""
    if not isinstance(net, list):
        raise ConfigError(path, "net", f"expected a list of layers, got {_kind(net)}")
    net, keys = expand_net(net, path)
    seen = {}
    for i, layer in enumerate(net):
        key = keys[i]
        if not isinstance(layer, dict):
            raise ConfigError(path, key, f"expected a layer mapping with 'type' and 'name', "
                                         f"got {_kind(layer)}")
        for field in ("type", "name"):
            if not isinstance(layer.get(field), str) or not layer[field]:
                raise ConfigError(path, f"{key}.{field}", f"every layer needs a '{field}' string, "
                                                          f"got {excerpt(layer.get(field))}")
        _check_names(layer, ("name", "top", "bottom", "thread"), key, path)
        parts = layer["name"].split("/")
        if any(part in ("", ".", "..") for part in parts):
            # its parameters '<name>/weight' are HDF5 paths of the checkpoint:
            # refused here, not at the first checkpoint after training
            raise ConfigError(path, f"{key}.name", f"layer name {excerpt(layer['name'])}: its "
                                                   "parts between '/' must be non-empty and "
                                                   "not '.' or '..' (the layer's parameters "
                                                   "are stored at /params/<name>/weight of a "
                                                   "checkpoint)")
        if layer["name"] in seen:
            raise ConfigError(path, f"{key}.name", f"duplicate layer name {excerpt(layer['name'])} "
                                                   f"(also {keys[seen[layer['name']]]})",
                                                   also=(keys[seen[layer["name"]]],))
        seen[layer["name"]] = i
        check_layer(layer, i, path, where=layer_key(keys, i))  # known type, declared keys (purine_mpi/layers)
    return copy.deepcopy(net), keys


def _check_names(entry, fields, key, path):
    """The names of a net's layer or a ``graph:`` entry (``fields``: its
    keys that hold a name or a list of names) hold no NUL (HDF5 ends a name
    at one; dot cannot say one) and no control character: graph, the logs
    and errors print these names, and an escape sequence or a line break in
    one would act on the terminal."""
    for field in fields:
        values = entry.get(field)
        for j, value in enumerate(values if isinstance(values, list) else [values]):
            if not isinstance(value, str):
                continue
            at = f"{key}.{field}" + (f".{j}" if isinstance(values, list) else "")
            if "\0" in value:
                raise ConfigError(path, at, f"{excerpt(value)} holds a NUL character "
                                            "(\\0), which no checkpoint (HDF5) name or "
                                            "Graphviz file can hold")
            if one_line(value) != value:
                raise ConfigError(path, at, f"{excerpt(value)} holds a control character "
                                            "(such as ESC, a line break or a bidirectional "
                                            "override), which graph and the logs would "
                                            "print as it is; names must be printable")


#: the keys of a ``graph:`` entry that hold blob, op or thread names (graph/seed_yaml.py;
#: ``graph`` prints an op's thread beside it)
_GRAPH_NAME_KEYS = ("name", "inputs", "outputs", "alias_of", "control_inputs", "thread")


def _check_graph(graph, path):
    if not isinstance(graph, list):
        raise ConfigError(path, "graph", f"expected a list of blob/op entries, got {_kind(graph)}")
    for i, entry in enumerate(graph):
        key = f"graph.{i}"
        if not isinstance(entry, dict):
            raise ConfigError(path, key, f"expected a mapping with 'type: blob' or 'type: op', "
                                         f"got {_kind(entry)}")
        if entry.get("type") not in ("blob", "op"):
            raise ConfigError(path, f"{key}.type", f"expected 'blob' or 'op', "
                                                   f"got {excerpt(entry.get('type'))}")
        if not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ConfigError(path, f"{key}.name", f"every {entry['type']} needs a 'name' "
                                                   f"string, got {excerpt(entry.get('name'))}")
        _check_names(entry, _GRAPH_NAME_KEYS, key, path)
    return copy.deepcopy(graph)


# ------------------------------------------------ rules between keys
#: the lr policies that decay from base_lr to a floor min_lr
_FLOOR_POLICIES = ("cosine",)


def _solver_rules(out, solver, path):
    """Keys of the solver that need each other."""
    out = out["solver"]
    policy = out["lr_policy"]
    if policy == "step" and out["stepsize"] is None:
        raise ConfigError(path, "solver.stepsize", "lr_policy 'step' needs a stepsize "
                                                   "(a positive integer number of iterations)",
                                                   also=("solver.lr_policy",))
    if policy == "multistep" and not out["stepvalues"]:
        raise ConfigError(path, "solver.stepvalues", "lr_policy 'multistep' needs stepvalues "
                                                     "(an increasing list of iterations)",
                                                     also=("solver.lr_policy",))
    if policy in _FLOOR_POLICIES and out["min_lr"] > out["base_lr"]:
        # a floor above the start: the rate would rise over the run, the
        # opposite of the decay the policy is chosen for (a swapped pair)
        raise ConfigError(path, "solver.min_lr", f"{out['min_lr']!r} is above solver.base_lr "
                          f"{out['base_lr']!r}: lr_policy {policy} decays the rate from "
                          "base_lr down to min_lr, so it would rise over the run; expected a "
                          f"number <= base_lr ({out['base_lr']!r})",
                          also=("solver.base_lr", "solver.lr_policy"))
    given = solver if isinstance(solver, dict) else {}
    if out["type"] in ("adagrad", "rmsprop") and given.get("momentum"):
        raise ConfigError(path, "solver.momentum", f"solver type {excerpt(out['type'])} takes no "
                          "momentum (as in Caffe); remove the key or set it to 0",
                          also=("solver.type",))


def _watch_rules(out, path):
    """``solver.early_stop`` and ``checkpoint.best`` watch a test figure: a
    net without ``data.test`` has no test pass, and each would do nothing
    without a word (no best file kept, never a stop)."""
    if out.get("net") is None or "test" in (out.get("data") or {}):
        return
    for key, what in (("solver.early_stop", "would never stop the run"),
                      ("checkpoint.best", "would keep no best checkpoint")):
        section, name = key.split(".")
        spec = out.get(section, {}).get(name)
        if spec is not None:
            raise ConfigError(path, key, f"watches the test figure {excerpt(spec['metric'])}, "
                              f"but the job has no data.test, so no test pass gives it and "
                              f"it {what}; add data.test or remove {key}", also=("data.test",))


def _parallel_rules(out, parallel, path):
    """The parallel keys against the solver's and the data's."""
    if out["parallel"]["scheme"] == AUTO_SCHEME and out["parallel"]["mode"] != "sync":
        # auto's choice (tools/choose.py) is one of the synchronous settings,
        # each of which says parallel.mode=sync: the job's mode would be
        # replaced without a word (parameter servers are never chosen)
        raise ConfigError(path, "parallel.mode", "parallel.scheme auto chooses among the "
                          "synchronous settings (mode sync), never parameter servers, so "
                          f"mode {excerpt(out['parallel']['mode'])} would not be kept; set "
                          "parallel.mode: sync, or set the scheme yourself (plan --choose "
                          "lists the parameter-server settings, unranked)",
                          also=("parallel.scheme",))
    if out["parallel"]["mode"] in ("async", "sync_ps") and out["solver"]["type"] != "sgd":
        raise ConfigError(path, "solver.type", f"parallel.mode {excerpt(out['parallel']['mode'])} "
                          f"(parameter servers) supports solver type 'sgd' only, got "
                          f"{excerpt(out['solver']['type'])}; use parallel.mode: sync",
                          also=("parallel.mode",))
    if out["solver"]["early_stop"] is not None and out["parallel"]["mode"] in ("async",
                                                                               "sync_ps"):
        # the workers' test passes decide it after the iteration's stop
        # agreement, which the servers took part in: they would wait for the
        # next iteration's gradients until the stall timeout
        raise ConfigError(path, "solver.early_stop", "early stopping works with "
                          "parallel.mode sync (any scheme), not with "
                          f"{excerpt(out['parallel']['mode'])} (parameter servers: they take "
                          "no part in the test passes that decide it); use "
                          "checkpoint.best to keep the best test passes instead",
                          also=("parallel.mode",))
    _check_pipeline(out, path)
    _check_sharded(out, path)
    _check_sync_batch_norm(out, path)
    if out["solver"]["clip_gradients"] is not None and (
            out["parallel"]["mode"] == "async" or (out["parallel"]["mode"] == "sync_ps"
                                                   and out["parallel"]["ps_ranks"] > 1)):
        raise ConfigError(path, "solver.clip_gradients", "clipping by the global norm needs "
                          "every gradient of an iteration in one place: it works with "
                          "parallel.mode sync (any scheme) and sync_ps with ps_ranks 1, not "
                          f"with mode {excerpt(out['parallel']['mode'])} and "
                          f"ps_ranks {out['parallel']['ps_ranks']}",
                          also=("parallel.mode", "parallel.ps_ranks"))


def _check_sync_batch_norm(out, path):
    """A ``batch_norm``'s ``sync: true`` (statistics summed over the
    replicas; in a ``graph:``, an op with attr ``REPLICA_SUM``, which the
    schemes sum alike) in mode sync under every scheme whose replicas
    share one global batch: data, sharded, hybrid, tensor and pipeline (one
    replica: its own sums), with tensor shards (the sums over the replicas
    alone) and micro-batches (each micro-batch's sums, PyTorch's per
    forward call); not scheme none (its replicas train apart) nor the
    parameter-server modes. Scheme auto's choice is checked when it is set."""
    par = out["parallel"]
    scheme = par["scheme"]
    if scheme == AUTO_SCHEME:
        return
    synced = [(f"{layer_key(out.get('_net_keys'), i)}.sync",
               f"layer '{layer['name']}' (batch_norm): sync: true", "sync: false")
              for i, layer in enumerate(out.get("net") or ())
              if layer_spec(layer["type"]).type == "batch_norm" and layer.get("sync") is True]
    synced += [(f"graph.{i}.attrs.{REPLICA_SUM}",
                f"op '{e['name']}' ({e.get('op_type')}): {REPLICA_SUM}: true",
                f"{REPLICA_SUM}: false")
               for i, e in enumerate(out.get("graph") or ()) if e.get("type") == "op" and
               isinstance(e.get("attrs"), dict) and e["attrs"].get(REPLICA_SUM)]
    for key, who, instead in synced:
        if par["mode"] != "sync":
            why = (f"parallel.mode {excerpt(par['mode'])}: parameter-server workers update on "
                   "their own, with no global batch; use mode: sync")
        elif scheme not in ("data", "sharded", "hybrid", "tensor", "pipeline"):
            why = (f"scheme {scheme} does not sum it (its replicas train apart, each on its "
                   "own batches: there is no global batch); use scheme data, sharded, hybrid, "
                   "tensor or pipeline")
        else:
            continue
        raise ConfigError(path, key, f"{who} (statistics of the global batch) is refused: "
                                     f"{why}, or {instead}",
                                     also=("parallel.mode", "parallel.scheme"))


def _check_sharded(out, path):
    """What scheme sharded does not build yet is refused, naming the key (a
    GPU, ``device`` or ``backend: cupy``, by the scheme's compose: the
    top-level keys are not read yet here)."""
    par = out["parallel"]
    if par["shard"] not in SHARD_STAGES:
        raise ConfigError(path, "parallel.shard", f"ZeRO's stages are 1, 2 and 3, got "
                          f"{par['shard']}")
    if par["scheme"] != "sharded":
        return
    why = ("scheme sharded builds ZeRO stages 1-3 on MPI on the CPU and on NCCL on GPUs "
           "(transport two_sided, no gradient clipping), with parallel.stages stages 1-3 "
           "on MPI on the CPU, and with parallel.tensor_parallel (with or without "
           "parallel.stages) stages 1-3 on MPI on the CPU")
    nccl = par["backend"] == "nccl"
    tensor = par["tensor_parallel"] > 1
    # (key, refused, in words, the other keys the refusal read)
    refused = [("parallel.mode", par["mode"] != "sync", f"mode {excerpt(par['mode'])}: "
                "parameter servers", ()),
               # with parallel.stages the world decides (the scheme's compose): one
               # replica runs as scheme pipeline, its transfers through windows; several
               # take it at shards 1 and 2 (the stage transfers through windows)
               ("parallel.transport", par["transport"] == "one_sided" and par["shard"] != 3
                and not par["stages"], f"transport one_sided with shard {par['shard']} "
                "(built for shard 3: one shared copy of the weights per node; and for "
                "parallel.stages, whose stage transfers go through windows)",
                ("parallel.shard", "parallel.stages")),
               ("parallel.transport", par["transport"] == "one_sided" and nccl,
                "transport one_sided with backend nccl", ("parallel.backend",)),
               ("solver.clip_gradients", nccl and out["solver"]["clip_gradients"] is not None,
                "clip_gradients with backend nccl (its allreduce of the shards' norms runs "
                "on MPI)", ("parallel.backend",)),
               ("parallel.backend", nccl and bool(par["stages"]), "backend nccl with "
                "parallel.stages (each stage's reduce-scatters run on MPI sub-communicators)",
                ("parallel.stages",)),
               ("parallel.backend", nccl and tensor, "backend nccl with "
                "parallel.tensor_parallel (each tensor shard's reduce-scatters run on MPI "
                "sub-communicators)", ("parallel.tensor_parallel",))]
    for key, bad, what, also in refused:
        also = ("parallel.scheme",) + also
        if bad:
            hint = " (parameter servers run under scheme data)" if key == "parallel.mode" \
                else ""
            raise ConfigError(path, key, f"{what} is refused: {why}; change this key{hint}",
            also=also)


def _check_pipeline(out, path):
    """Cross-key rules of parallel.micro_batches and parallel.stages."""
    par = out["parallel"]
    micro = par["micro_batches"]
    if micro > 1:
        train = (out.get("data") or {}).get("train") or {}
        batch = train.get("batch_size")
        if batch is not None and batch % micro:
            raise ConfigError(path, "parallel.micro_batches", f"{micro} micro-batches do not "
                              f"divide data.train.batch_size {batch}; choose a divisor",
                              also=("data.train.batch_size",))
        for i, layer in enumerate(out.get("net") or ()):
            # a train-phase metric is not copied per micro-batch (parallel/micro_batch.py)
            if layer_spec(layer["type"]).type == "accuracy" and layer.get("phase") != "test":
                raise ConfigError(path, f"{layer_key(out.get('_net_keys'), i)}.phase",
                                  f"layer '{layer['name']}' "
                                  "(accuracy) runs in the train phase, which parallel."
                                  f"micro_batches {micro} does not build (each micro-batch "
                                  "would need its own accuracy); give it phase: test, or use "
                                  "micro_batches: 1", also=("parallel.micro_batches",))
    scheme = par["scheme"]
    if scheme == "tensor" or (scheme == "sharded" and par["tensor_parallel"] > 1):
        what = "scheme tensor" if scheme == "tensor" else \
            "scheme sharded with parallel.tensor_parallel"
        if par["mode"] != "sync":
            raise ConfigError(path, "parallel.mode", f"{what} runs with mode: sync, not "
                              f"{excerpt(par['mode'])} (parameter servers serve data-parallel "
                              "workers)", also=("parallel.scheme", "parallel.tensor_parallel"))
        if micro > 1 and not par["stages"]:  # with stages: the pipeline's micro-batches
            raise ConfigError(path, "parallel.micro_batches", f"{what} takes no "
                              f"micro-batches (got {micro}); use 1",
                              also=("parallel.scheme", "parallel.tensor_parallel"))
    if par["tensor_parallel"] > 1 and scheme == "tensor" and par["stages"]:
        key = "parallel.stages"
        raise ConfigError(path, key, f"scheme {scheme} with {key} is refused: tensor "
                          "parallelism within pipeline stages (parallel.stages and "
                          "parallel.tensor_parallel) is scheme pipeline's (one replica of p "
                          "stages x t tensor shards) and scheme hybrid's (R replicas of it); "
                          f"use scheme: pipeline or hybrid, or drop {key}",
                          also=("parallel.scheme", "parallel.tensor_parallel"))
    count = par["stages"] if _is_int(par["stages"]) else None
    if scheme not in ("pipeline", "hybrid") and not (scheme == "sharded" and par["stages"]):
        if count is not None:
            raise ConfigError(path, "parallel.stages", f"scheme {scheme} takes no stages (got "
                              f"{count}); the schemes pipeline, hybrid and sharded do",
                              also=("parallel.scheme",))
        return
    if par["mode"] != "sync":
        raise ConfigError(path, "parallel.mode", f"scheme {scheme} runs with mode: sync, not "
                          f"{excerpt(par['mode'])} (parameter servers serve data-parallel workers)",
                          also=("parallel.scheme", "parallel.stages"))
    if out.get("net") is None:
        if count is not None:
            raise ConfigError(path, "parallel.stages", f"{count} stages cut a 'net' (its "
                              "layers); with a 'graph' give no parallel.stages", also=("graph",))
        return
    if count is not None:
        layers = len(out["net"])
        if count > layers:
            raise ConfigError(path, "parallel.stages", f"{count} stages for a net of {layers} "
                              f"layers; give at most {layers} (each stage holds a layer)",
                              also=("net",))
        return  # validate_config resolves it into the map (job/stage_cut.py), checked again
    if not par["stages"]:
        raise ConfigError(path, "parallel.stages", f"scheme {scheme} needs a mapping layer -> "
                          "stage for every layer, e.g. {conv1: 0, fc1: 1}",
                          also=("parallel.scheme",))
    names = [layer.get("name") for layer in out["net"]]
    unknown = sorted(set(par["stages"]) - set(names))
    if unknown:
        raise ConfigError(path, "parallel.stages", f"no layer named {', '.join(unknown)} in "
                          "the net", also=("net",))
    missing = [n for n in names if n not in par["stages"]]
    if missing:
        raise ConfigError(path, "parallel.stages", f"layer(s) {', '.join(missing)} have no "
                          "stage; give every layer of the net a stage", also=("net",))
    count = max(par["stages"].values()) + 1
    empty = [s for s in range(count) if s not in par["stages"].values()]
    if empty:
        raise ConfigError(path, "parallel.stages", f"stage(s) {', '.join(map(str, empty))} "
                          f"have no layers; number the stages 0..{count - 1 - len(empty)}")
    _check_stage_order(out["net"], par["stages"], path)
    if scheme in ("hybrid", "sharded") and count < 2:
        alone = "use scheme: data" if scheme == "hybrid" else "drop parallel.stages"
        raise ConfigError(path, "parallel.stages", f"scheme {scheme} with stages needs at least "
                          "2 stages (replicas x stages), but every layer is on stage 0; with "
                          f"one stage {alone}", also=("parallel.scheme",))


def _check_stage_order(net, stages, path):
    """Each layer's stage is at least that of the layers whose tops it reads:
    a pipeline's stages run in order (a later stage never feeds an earlier
    one, which would make the stages wait for each other)."""
    writer = {}  # blob -> (layer, stage) of its latest writer
    for layer in net:
        stage = stages[layer["name"]]
        for blob in _blob_names(layer.get("bottom")):
            if blob in writer and writer[blob][1] > stage:
                before, at = writer[blob]
                raise ConfigError(path, "parallel.stages", f"layer {layer['name']} on stage "
                                  f"{stage} reads '{blob}' of layer {before} on stage {at}: "
                                  "the stages run in order; give each layer a stage at least "
                                  "that of the layers it reads", also=("net",))
        for blob in _blob_names(layer.get("top", layer["name"])):
            writer[blob] = (layer["name"], stage)


def _blob_names(value):
    return [value] if isinstance(value, str) else [b for b in value or () if isinstance(b, str)]


_STRUCTURE = {"graph": _check_graph}
_SECTION_RULES = {"solver": _solver_rules, "parallel": _parallel_rules}

#: the sections with declared keys: name -> ({key: default}, {key: checker})
SECTIONS = {name: ({key.name: key.default for key in keys}, {key.name: key.check for key in keys})
            for name, keys in SECTION_KEYS.items()}


#: the rate keys some lr_policy reads and another not (_POLICY_KEYS); max_iter
#: is the run's length whatever the policy
_POLICY_ONLY_KEYS = ("gamma", "stepsize", "stepvalues", "power", "min_lr")
#: the update keys some solver type reads and another not (UPDATE_KEYS)
_TYPE_ONLY_KEYS = ("momentum", "momentum2", "delta", "rms_decay")


def solver_notes(job):
    """One start-up line for each solver key set (to something else than
    its default, docs/config.md) that the solver type or the lr_policy does
    not read, naming the file, the key and why: accepted (Caffe-converted
    configs carry every key of their solver), but a user who set it believes
    it acts (a key a ``--set`` wrote: that ``--set``). ``momentum: 0`` under
    adagrad or rmsprop (which take none) is what their error asks for, not
    noted."""
    from ..graph.solver_graph import UPDATE_KEYS
    solver = job.solver
    defaults = {key.name: key.default for key in SOLVER}
    in_file = f"{job.path}: " if job.path and not str(job.path).startswith("<") else ""
    notes = []

    def note(key, why):
        value = getattr(solver, key)
        if value is None or value == defaults[key] or (
                isinstance(value, (list, tuple)) and list(value) == list(defaults[key])):
            return
        source = _override_at(f"solver.{key}", job.overrides, None)  # the --set that wrote it
        where = f"--set {excerpt(source, quote=False)}: " if source is not None else in_file
        notes.append(f"note: {where}solver.{key} {excerpt(value)} is not used: {why}")

    policy = solver.lr_policy
    reads = _POLICY_KEYS.get(policy, ())
    for key in _POLICY_ONLY_KEYS:
        if key not in reads:
            what = f"reads {', '.join(reads)}" if reads else "reads none of gamma, stepsize, " \
                "stepvalues, power, min_lr"
            note(key, f"lr_policy {policy} {what}")
    kind = solver.type or "sgd"
    used = UPDATE_KEYS.get(kind, ())
    for key in _TYPE_ONLY_KEYS:
        if key in used or (key == "momentum" and not getattr(solver, key)):
            continue
        note(key, f"solver type {kind} reads {', '.join(used)}")
    return notes
