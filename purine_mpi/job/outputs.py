"""What an output file (``--out`` of ``predict``, ``export``, ``convert``,
``data``) may replace: never an input of the same command (the
``--weights`` file, the config, its data files, a mean file) and never one
of our checkpoints. ``refuse_replacing`` says so before anything is
computed or written (a UserError naming both, exit 2). ``check_out`` also
refuses an ``--out`` that is an existing folder: each of these commands
writes one file.
"""
import os

from ..base.errors import UserError
from .rundir_force import is_our_checkpoint


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
