"""``train --force``: delete what a run of ours wrote in a folder, recognised
by content, never by name alone.

- a checkpoint (``ckpt_<iter>.h5``, ``latest.h5``, ``best_<iter>.h5``): an
  HDF5 file whose root says ``format = purine_mpi.checkpoint``;
- ``metrics.jsonl`` (and a resumed run's ``metrics.jsonl.resumed.<pid>``):
  every whole line one of our records (a JSON object with ``phase`` and
  ``iter``);
- ``train.log``: it starts with our ``--- <date> pid <pid> ---`` line;
- ``trace.rank<R>.json``: our trace's first bytes;
- TensorBoard event files (``events.out.tfevents.*``, and ``tb/`` when it
  holds only such files): a TFRecord whose first event is ``brain.Event``;
- ``config.yaml``: a resolved config (a mapping with the sections a run
  writes), deleted only when the folder holds a run by one of the above.

Files of a run's names that are none of these (a user's own ``config.yaml``
or ``tb/``) are never deleted: ``--force`` then refuses (exit 2, naming
them) and deletes nothing. Nothing is followed through a symbolic link.
"""
import json
import os
import re
import stat

from ..base.errors import UserError

_RUN_FILE_RE = re.compile(r"^(metrics\.jsonl(\.resumed\.\d+)?|latest\.h5|ckpt_\d+\.h5|"
                          r"best_\d+\.h5|train\.log|trace\.rank\d+\.json|"
                          r"config\.yaml|events\.out\.tfevents\..*|tb)$")
#: files a run writes by a rename over the name (``write_text_replacing``), which
#: are no run of their own (``run_files`` leaves them out, ``--force`` keeps them)
_REPLACED_FILES = ("memory.json", "calibration.json")


def run_files(folder):
    """The files of a run in ``folder`` (sorted names; [] if none), with its
    TensorBoard folder ``tb``."""
    if not os.path.isdir(folder):
        return []
    names = sorted(n for n in os.listdir(folder) if _RUN_FILE_RE.match(n))
    # a log alone is what a run that failed before its first file left: the
    # folder holds no run to protect (a new run appends to the log)
    return [] if names == ["train.log"] else names


_LOG_HEAD = re.compile(rb"^--- \d{4}-\d\d-\d\d \d\d:\d\d:\d\d pid \d+ ---\n")
_CKPT_NAME = re.compile(r"^(latest|ckpt_\d+|best_\d+)\.h5$")
_CONFIG_KEYS = ("name", "seed", "solver", "parallel", "checkpoint")


def _regular(path):
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _head(path, n=256):
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        return os.read(fd, n)
    finally:
        os.close(fd)


def is_our_checkpoint(path):
    """Whether ``path`` is a regular file holding one of our checkpoints."""
    if not signature_first(path):
        return False
    import h5py
    try:
        with h5py.File(path, "r") as f:
            return holds_our_format(f)
    except (OSError, ValueError, KeyError):
        return False


def signature_first(path):
    """Whether ``path`` is a regular file (not followed through a link)
    starting with HDF5's signature: no user block before it, as every file
    we write (one with a user block is never taken for our checkpoint)."""
    if not _regular(path):
        return False
    try:
        return _head(path, 8) == b"\x89HDF\r\n\x1a\n"
    except OSError:
        return False


def holds_our_format(f):
    """Whether the open HDF5 file ``f`` has our checkpoint's ``format``
    root attribute (text; bytes are not ours)."""
    from .checkpoint_file import FORMAT
    return str(f.attrs.get("format", "")) == FORMAT


def _metrics_rows(path):
    """The number of our records in a metrics file, or None if any whole
    line is not one of them."""
    if not _regular(path):
        return None
    rows = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # a last line cut short by a kill
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                return None
            if not isinstance(rec, dict) or "phase" not in rec or "iter" not in rec:
                return None
            rows += 1
    return rows


def _is_event_file(path):
    return _regular(path) and b"brain.Event" in _head(path, 64)


def _is_tb_folder(path):
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    names = os.listdir(path)
    return bool(names) and all(n.startswith("events.out.tfevents.")
                               and _is_event_file(os.path.join(path, n)) for n in names)


def _is_config(path):
    if not _regular(path):
        return False
    import yaml  # here: the command line's start-up (--help, usage errors) reads no YAML

    from .yamlread import read_yaml
    try:
        with open(path) as f:
            cfg = read_yaml(f, path)  # the strict, bounded reader: the file is not ours yet
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(cfg, dict) and all(k in cfg for k in _CONFIG_KEYS) \
        and ("net" in cfg or "graph" in cfg)


def recognise(folder, held):
    """(ours, evidence, foreign): the names of ``held`` that a run of ours
    wrote, whether any of them shows that a run of ours was there, and the
    names that are not recognisably ours."""
    ours, foreign, evidence = [], [], False
    pending_config = None
    for name in held:
        path = os.path.join(folder, name)
        if _CKPT_NAME.match(name):
            ok = is_our_checkpoint(path)
            evidence |= ok
        elif name.startswith("metrics.jsonl"):
            rows = _metrics_rows(path)
            ok = rows is not None
            evidence |= bool(rows)
        elif name == "train.log":
            ok = _regular(path) and bool(_LOG_HEAD.match(_head(path, 80)))
            evidence |= ok
        elif name.startswith("trace.rank"):
            ok = _regular(path) and _head(path, 20).startswith(b'{"displayTimeUnit"')
            evidence |= ok
        elif name == "tb":
            ok = _is_tb_folder(path)
            evidence |= ok
        elif name.startswith("events.out.tfevents."):
            ok = _is_event_file(path)
            evidence |= ok
        elif name == "config.yaml":
            pending_config = name if _is_config(path) else None
            ok = pending_config is not None
        else:
            ok = False
        (ours if ok else foreign).append(name)
    if pending_config and not evidence:  # a config alone is no proof of a run
        ours.remove(pending_config)
        foreign.append(pending_config)
    if not evidence:  # no run of ours here: --force deletes nothing
        foreign, ours = sorted(set(foreign) | set(ours)), []
    return ours, evidence, sorted(foreign)


def delete_our_run(out, held, keep=None):
    """``--force`` into ``out`` holding ``held`` (run_files): delete what a run
    of ours wrote there, except the file ``keep`` (a realpath: the
    checkpoint this run starts from). Refuses (UserError, exit 2) before
    deleting anything when a file of a run's names is not recognisably
    ours."""
    ours, _, foreign = recognise(out, held)
    if foreign:
        raise UserError(f"--out {out}: --force deletes only the files a run of purine_mpi "
                        f"wrote, recognised by their content, and {', '.join(foreign[:4])}"
                        f"{', ...' if len(foreign) > 4 else ''} "
                        f"{'is' if len(foreign) == 1 else 'are'} not; nothing was deleted: "
                        "move them away or give another --out")
    for name in ours:
        path = os.path.join(out, name)
        if keep is not None and os.path.realpath(path) == keep:
            continue  # the checkpoint this run starts from stays
        if name == "tb":
            for n in os.listdir(path):
                os.remove(os.path.join(path, n))
            os.rmdir(path)
        else:
            os.remove(path)  # never follows a link: unlinks the name itself
