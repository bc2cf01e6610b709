"""The run folder's log file, ``OUT/train.log``: the lines rank 0 prints
(the start-up block, progress, test figures, notes), appended across
resumes, and the errors of any rank, so a batch job's folder keeps what its
terminal showed (as Caffe's GLOG files and Lightning's loggers do).

``open_run_log(out_dir, rank)`` registers the file for this process;
``tee(log)`` makes a log function that also appends each line there (rank
0); ``note_error(text, rank)`` appends an error from any rank, in one
write, so lines of two ranks never interleave. Standard library only: the
error paths of every layer may call it.

Layer: foundation (docs/DESIGN.md); may import only its own layer (the bottom
one), the standard library and third-party packages.
"""
import os
import time

from .errors import UserError
from .runfiles import open_run_fd, write_all

LOG_NAME = "train.log"
_path = None
_rank = 0


def open_run_log(out_dir, rank=0):
    """Log this run into ``out_dir/train.log`` (returns the path)."""
    global _path, _rank
    _path, _rank = os.path.join(str(out_dir), LOG_NAME), int(rank)
    if _rank == 0:
        os.makedirs(str(out_dir), exist_ok=True)
        _append(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} ---")
    return _path


def close_run_log():
    global _path
    _path = None


def _append(line):
    if _path is None:
        return
    try:  # never through a link planted there (runfiles.py); a whole line or none
        fd = open_run_fd(_path, append=True)
        try:
            write_all(fd, (line.rstrip("\n") + "\n").encode("utf-8", "replace"), _path)
        finally:
            os.close(fd)
    except (OSError, UserError):
        pass  # the terminal still has it; a full disk must not end the run


def tee(log):
    """A log function that calls ``log`` and appends the line to train.log."""
    def both(msg):
        if _rank == 0:
            _append(str(msg))
        log(msg)
    return both


def note_error(text, rank=None):
    """An error of any rank, appended to train.log when a run registered it."""
    text = str(text)
    if text.startswith(("error", "rank ")):  # it says what and where already
        _append(text)
    else:
        _append(f"error (rank {_rank if rank is None else rank}): {text}")
