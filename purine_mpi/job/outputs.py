"""What an output file (``--out`` of ``predict``, ``export``, ``convert``,
``data``) may replace: never an input of the same command (the
``--weights`` file, the config, its data files, a mean file) and never one
of our checkpoints. ``refuse_replacing`` says so before anything is
computed or written (a UserError naming both, exit 2). ``check_out`` also
refuses an ``--out`` that is an existing folder: each of these commands
writes one file. ``refuse_other_kind`` (``predict`` and ``data``, which
write HDF5 by a rename over ``--out``) refuses an existing ``--out`` that
holds something else than what the command writes (a data file for
``predict``, predictions for ``data``, a file that is not HDF5 or an HDF5
file of another program), unless ``--force``. ``refuse_other_json`` is
its counterpart for the JSON files of ``plan --choose --calibration`` and
``predict --calibrate``, caches a later run replaces whole: never a file
that is not one (a config, a data file given by mistake).
"""
import json
import os

from ..base.errors import UserError
from .rundir_force import (_REPLACED_FILES, _RUN_FILE_RE, holds_our_format, is_our_checkpoint,
                           recognise, run_files, signature_first)


def job_inputs(job):
    """[(what, path)] of the files a job reads: its data files and mean files."""
    found = []
    for phase in ("train", "test"):
        spec = job.data.get(phase) if job is not None else None
        if spec is None:
            continue
        for key in ("path", "mean_file"):
            if getattr(spec, key, None):
                found.append((f"data.{phase}.{key}", getattr(spec, key)))
    return found


def refuse_replacing(out, option, inputs):
    """A UserError if writing ``out`` would replace one of ``inputs``
    ([(what, path)]) or a checkpoint of ours; nothing when ``out`` does not
    exist yet."""
    if not out or not os.path.exists(out):
        return
    for what, path in inputs:
        try:
            same = bool(path) and os.path.samefile(out, path)
        except OSError:
            continue  # a missing input is reported where it is read
        if same:
            raise UserError(f"{option} {out} is {what} {path} of this command: writing the "
                            f"output there would replace it; give another {option}")
    if os.path.isfile(out) and is_our_checkpoint(os.path.realpath(out)):
        raise UserError(f"{option} {out} is a purine_mpi checkpoint: writing the output there "
                        f"would replace it; give another {option}")
    folder = run_folder_of(out)
    if folder is not None:
        raise UserError(f"{option} {out} is the {os.path.basename(out)} of the run in "
                        f"{folder}: writing the output there would replace that run's record; "
                        f"give another {option}")


def run_folder_of(path):
    """The folder of the existing file ``path`` when it is one of the files
    a run wrote there (its metrics.jsonl, train.log, config.yaml,
    memory.json, ...: job/rundir_force.py's ``run_files``) and the folder holds a
    run of ours (job/rundir_force.py's ``recognise``, as ``train --force``
    tells one: a config.yaml alone, e.g. a ``convert`` output written
    again, is no run), else None."""
    if not os.path.isfile(path):
        return None
    folder = os.path.dirname(os.path.abspath(path)) or "."
    name = os.path.basename(path)
    if not (_RUN_FILE_RE.match(name) or name in _REPLACED_FILES):
        return None
    held = run_files(folder)
    return (os.path.dirname(path) or ".") if held and recognise(folder, held)[1] else None


def file_in_the_way(path):
    """The first existing ancestor of ``path`` (its folders, nearest the
    root first) that is not a folder, or None: the folder an output goes
    into cannot be made under a file."""
    parts = []
    head = os.path.dirname(os.path.abspath(path))
    while head and head not in parts:
        parts.append(head)
        head = os.path.dirname(head)
    for folder in reversed(parts):
        if os.path.lexists(folder) and not os.path.isdir(folder):
            return folder
    return None


def refuse_under_a_file(out, option="--out", what="the output"):
    """A UserError when one of ``out``'s folders is an existing file."""
    blocker = file_in_the_way(out) if out else None
    if blocker is not None:
        raise UserError(f"{option} {out}: {blocker} is a file, not a folder, so {what} "
                        f"cannot be written under it; give another {option}")


def check_out(out, config=None, weights=None, job=None, more=()):
    """``refuse_replacing`` for a command's ``--out``: its config, its
    ``--weights``, the job's data files and ``more`` ([(what, path)]); and
    a UserError when ``out`` is an existing folder (the output is a file)
    or lies under a file (its folder cannot be made)."""
    if out and os.path.isdir(out):
        raise UserError(f"--out {out} is a folder, but the output is one file: give the "
                        "file's path")
    refuse_under_a_file(out)
    inputs = [("the config", config), ("the --weights file", weights), *more]
    refuse_replacing(out, "--out", inputs + job_inputs(job))


#: what ``refuse_other_kind`` tells apart: the root attribute ``format`` of
#: the HDF5 files our commands write (docs/formats.md), as a kind
_FORMAT_KINDS = {"purine_mpi.predictions": "predictions", "purine_mpi.text": "data"}
#: each kind in words, for the refusal
KIND_WORDS = {"predictions": "the predictions of predict", "data": "a data file",
              "checkpoint": "a purine_mpi checkpoint", "other": "HDF5 data of another kind"}


def hdf5_kind(path):
    """(kind, detail) of the existing regular file ``path``: ``checkpoint``,
    ``predictions`` (``predict``'s), ``data`` (``data text``'s, or ``data``
    and ``label`` datasets at the top or in a top-level group: the layout
    ``source: hdf5`` reads, docs/formats.md), ``empty`` (an HDF5 file
    holding nothing, or a file of 0 bytes), ``other`` (HDF5 of another kind) or ``not-hdf5``;
    ``detail``: what it holds, in a few words (its top-level names)."""
    import h5py
    try:
        if os.path.getsize(path) == 0:  # ``mktemp x.XXXX.h5``, ``touch``: nothing to lose
            return "empty", ""
        if not h5py.is_hdf5(path):
            return "not-hdf5", ""
        ours = signature_first(path)  # (is_our_checkpoint's rule, on this one open)
        with h5py.File(path, "r") as f:
            if ours and holds_our_format(f):
                return "checkpoint", ""
            names = sorted(f)
            fmt = f.attrs.get("format")
            fmt = fmt.decode("utf-8", "replace") if isinstance(fmt, bytes) else fmt
            if isinstance(fmt, str) and fmt in _FORMAT_KINDS:
                return _FORMAT_KINDS[fmt], ""
            groups = [f] + [f[n] for n in names if f.get(n, getclass=True) is h5py.Group]
            if any(g.get(k, getclass=True) is h5py.Dataset
                   for g in groups for k in ("data", "label")):
                return "data", _names(names)
            if not names and not len(f.attrs):
                return "empty", ""
            return "other", _names(names) or "no objects, root attributes " + \
                ", ".join(sorted(f.attrs))[:80]
    except (OSError, ValueError, KeyError, RuntimeError):
        return "other", "unreadable as HDF5"


def _names(names):
    shown = ", ".join(str(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
    return f"top level: {shown}" if names else ""


def refuse_other_kind(out, kind, what, force=False, option="--out"):
    """A UserError when the existing file ``out`` holds something else than
    the ``kind`` of file the command writes (``what``, in words): writing
    there (by a rename over the name, base/runfiles.write_hdf5_replacing)
    would replace it without a word. A file of the same kind, an empty HDF5
    file and a missing one may be replaced; ``force`` replaces any other but
    a checkpoint of ours (``refuse_replacing`` keeps that one, as it keeps
    the command's inputs)."""
    if not out or not os.path.isfile(out):
        return
    have, detail = hdf5_kind(out)
    if have in (kind, "empty") or (force and have != "checkpoint"):
        return
    if have == "checkpoint":  # refuse_replacing's words
        raise UserError(f"{option} {out} is a purine_mpi checkpoint: writing the output there "
                        f"would replace it; give another {option}")
    held = "is not an HDF5 file" if have == "not-hdf5" else \
        "holds " + KIND_WORDS[have] + (f" ({detail})" if detail else "")
    raise UserError(f"{option} {out} exists and {held}: writing {what} there would "
                    f"replace it; give another {option}, or --force to replace it")


def refuse_other_json(path, option, what, ours):
    """A UserError (exit 2) when the existing file ``path`` (given with
    ``option``) is not one ``ours`` (a test of its parsed JSON object)
    accepts: writing ``what`` there, by a rename over the name, would
    replace a file of the user's (``plan --choose --calibration job.yaml``
    replaced the config with the calibration). A missing or empty file may
    be written; a file of ours (another job's calibration, an older format)
    is replaced, as the cache it is. A file that does not start as a JSON
    object is told from its first bytes, not read whole."""
    if not path or not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    try:
        with open(path, "rb") as f:
            first = f.read(4096).lstrip()[:1]
            f.seek(0)
            if first == b"{" and os.path.getsize(path) <= _JSON_MAX:
                try:
                    if ours(json.loads(f.read().decode("utf-8"))):
                        return
                    held = "holds JSON of another kind"
                except ValueError:  # not UTF-8, not JSON
                    held = "is not JSON"
            else:
                held = "is not a JSON object" if first != b"{" else \
                    f"holds over {_JSON_MAX >> 20} MiB, more than this command writes"
    except OSError:
        return  # unreadable: the write says why where it fails
    raise UserError(f"{option} {path} exists and {held}: writing {what} there would replace "
                    f"it; give another {option}, or remove the file first")


#: the largest JSON file ``refuse_other_json`` reads to tell its kind
_JSON_MAX = 256 << 20
