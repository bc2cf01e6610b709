"""A run folder's checkpoints (docs/formats.md, "Run folders"):
``ckpt_<iter>.h5`` written atomically beside ``latest.h5``, rotation of
one run's checkpoints, the file ``--resume auto`` continues from (never
past a checkpoint another process holds), and the temp files of killed
writers. The files themselves are ``job/checkpoint_file``'s.
"""
import os
import re
import shutil

from ..base.errors import UserError
from .checkpoint_file import (LATEST, Checkpoint, FileHeld, load_checkpoint, replaced_atomically,
                              save_checkpoint)

_CKPT_RE = re.compile(r"^ckpt_(\d+)\.h5$")
_BEST_RE = re.compile(r"^best_(\d+)\.h5$")
#: a killed writer's temporary file: a checkpoint's (``<name>.h5.tmp.<pid>``),
#: memory.json's, calibration.json's or metrics.jsonl's rewrite
#: (``base/runfiles.temp_name``), or the metrics file of a resumed run killed
#: before its first checkpoint (``metrics.jsonl.resumed.<pid>``, job/metrics.py)
_TMP_RE = re.compile(r"^(?:.+\.h5|memory\.json|calibration\.json|metrics\.jsonl)\.tmp\.(\d+)$"
                     r"|^metrics\.jsonl\.resumed\.(\d+)$")


def save_run_checkpoint(out_dir, iteration, keep=3, replaced=None, **kw):
    """Write ``out_dir/ckpt_<iteration>.h5`` (atomically), point
    ``latest.h5`` at it (atomically) and delete checkpoints beyond the
    ``keep`` newest, and the run's checkpoints of later iterations (a
    replaced continuation: ``rotate_checkpoints``; ``replaced``, a list,
    gets their paths). ``kw`` are ``save_checkpoint``'s other arguments."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"ckpt_{int(iteration)}.h5")
    save_checkpoint(path, iteration=iteration, **kw)
    write_latest(out_dir, path)
    rotate_checkpoints(out_dir, keep, kw.get("run_id"), iteration, replaced)
    return path


def write_latest(out_dir, ckpt_path):
    """Make ``out_dir/latest.h5`` a complete copy of ``ckpt_path``: a hard
    link (or a copy where links fail) under a temp name, renamed over it."""
    latest = os.path.join(out_dir, LATEST)
    with replaced_atomically(latest) as tmp:
        try:
            os.link(ckpt_path, tmp)
        except OSError:  # file systems without hard links
            shutil.copyfile(ckpt_path, tmp)
    return latest


def list_checkpoints(out_dir):
    """[(iteration, path)] of ``ckpt_<iter>.h5`` in ``out_dir``, oldest first."""
    if not os.path.isdir(out_dir):
        return []
    found = [(int(m.group(1)), os.path.join(out_dir, name))
             for name in os.listdir(out_dir) for m in [_CKPT_RE.match(name)] if m]
    return sorted(found)


def rotate_checkpoints(out_dir, keep, run_id=None, iteration=None, replaced=None):
    """Delete ``ckpt_<iter>.h5`` files beyond the ``keep`` newest (keep <= 0:
    keep all). ``latest.h5`` is never deleted. With ``run_id``, only that
    run's checkpoints (attribute ``run_id``) count and are deleted: another
    run's files in the folder are left alone. With ``run_id`` and
    ``iteration`` (the checkpoint just written) that run's checkpoints of
    later iterations are a continuation a resume from an earlier one
    replaced (``replaced_files``): deleted, whatever ``keep``, and added to
    the list ``replaced`` when given. Returns the deleted paths."""
    doomed = replaced_files(out_dir, _CKPT_RE, run_id, iteration) \
        if run_id and iteration is not None else []
    for path in doomed:
        os.remove(path)
    if replaced is not None:
        replaced.extend(doomed)
    if keep is None or keep <= 0:
        return doomed
    ours = list_checkpoints(out_dir)
    if run_id:
        ours = [(it, path) for it, path in ours if checkpoint_run_id(path) == run_id]
    old = [path for _, path in ours[:-keep]]
    for path in old:
        os.remove(path)
    return doomed + old


def replaced_files(out_dir, pattern, run_id, after, kept=None):
    """Paths of run ``run_id``'s files in ``out_dir`` named by ``pattern``
    (a regex whose group 1 is the iteration) of iterations above ``after``
    and not named in ``kept`` (file names). A run's iterations only grow,
    so once it resumed from iteration ``after``, such files were written
    by the continuation the resume replaced (another run's files stay)."""
    if not os.path.isdir(out_dir):
        return []
    found = sorted((int(m.group(1)), name) for name in os.listdir(out_dir)
                   for m in [pattern.match(name)] if m and int(m.group(1)) > int(after)
                   and name not in (kept or ()))
    return [os.path.join(out_dir, name) for _, name in found
            if checkpoint_run_id(os.path.join(out_dir, name)) == run_id]


def remove_replaced_best(out_dir, run_id, after, kept):
    """Delete run ``run_id``'s ``best_<iter>.h5`` of iterations above
    ``after`` (the checkpoint the run resumed from) that its best list
    ``kept`` (file names) does not hold: a replaced continuation's.
    Returns the deleted paths."""
    doomed = replaced_files(out_dir, _BEST_RE, run_id, after, kept) if run_id else []
    for path in doomed:
        try:
            os.remove(path)
        except OSError:
            pass
    return doomed


def checkpoint_run_id(path):
    """The ``run_id`` attribute of a checkpoint file ('' if none or unreadable)."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            return str(f.attrs.get("run_id", ""))
    except (OSError, KeyError):
        return ""


def find_latest(out_dir):
    """The checkpoint ``--resume auto`` continues from: ``latest.h5``, else
    the newest ``ckpt_<iter>.h5``, else None."""
    latest = os.path.join(out_dir, LATEST)
    if os.path.isfile(latest):
        return latest
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1][1] if ckpts else None


def find_resumable(out_dir, log=None):
    """(path, Checkpoint) that ``--resume auto`` continues from: ``latest.h5``
    if it loads (or a newer ``ckpt_<iter>.h5`` of its run that loads: a
    writer killed between the two renames, ``_newer_of_its_run``), else the
    newest ``ckpt_<iter>.h5`` that loads (``log`` is
    told which file was skipped and why), else (None, None). Every rank that
    calls this on the same folder picks the same file."""
    candidates = [os.path.join(out_dir, LATEST)] * os.path.isfile(os.path.join(out_dir, LATEST))
    candidates += [path for _, path in reversed(list_checkpoints(out_dir))]
    skipped = []
    for path in candidates:
        try:
            ck = load_checkpoint(path)
        except FileHeld as e:  # not damaged: an older checkpoint would redo work for nothing
            raise FileHeld(f"--resume auto: {e}; not falling back to an older checkpoint") \
                from None
        except UserError as e:
            skipped.append(str(e))
            continue
        if skipped and log:
            log(f"warning: {'; '.join(skipped)}; resuming from '{path}' (iteration "
                f"{ck.iteration}), the newest checkpoint that loads")
        if os.path.basename(path) == LATEST:
            return _newer_of_its_run(out_dir, path, ck, log)
        return path, ck
    if skipped:
        raise UserError(f"--resume auto: no checkpoint in '{out_dir}' loads: {'; '.join(skipped)}")
    return None, None


def _newer_of_its_run(out_dir, latest, ck, log=None):
    """(path, Checkpoint): ``latest`` (``latest.h5``, read as ``ck``), or
    the newest ``ckpt_<iter>.h5`` of its run past its iteration that loads:
    a writer killed between the rename of the new checkpoint and that of
    ``latest.h5`` (save_run_checkpoint) left the complete one beside the
    older ``latest.h5``, which a resume would take, redoing the iterations
    between and deleting the newer file as a replaced continuation. Only a
    file written after ``latest.h5``: a run resumed on purpose from an
    earlier checkpoint and killed before its rotation deleted the
    continuation it replaced left that continuation's files, of the same
    run and higher iterations but older than ``latest.h5``, which must not
    come back."""
    run_id = str(ck.attrs.get("run_id", ""))
    try:
        latest_written = os.stat(latest).st_mtime_ns
    except OSError:
        return latest, ck
    for iteration, path in reversed(list_checkpoints(out_dir)):
        if iteration <= ck.iteration or not run_id:
            break
        try:
            if os.stat(path).st_mtime_ns < latest_written:
                continue  # written before latest.h5: a replaced continuation's
        except OSError:
            continue
        if checkpoint_run_id(path) != run_id:
            continue
        try:
            newer = load_checkpoint(path)
        except UserError:
            continue
        if newer.iteration != iteration:
            continue
        if log:
            log(f"note: resuming from '{path}' (iteration {iteration}), complete and newer "
                f"than {LATEST} (iteration {ck.iteration}): the run ended between the two "
                "writes")
        return path, newer
    return latest, ck


def resolve_resume(out_dir, resume, log=None, init=None):
    """The Checkpoint ``--resume`` continues from: ``resume`` is a path,
    ``"auto"`` (``find_resumable`` in ``out_dir``) or a Checkpoint already
    read (returned as it is); None without ``resume`` or for ``"auto"`` in a
    folder without a checkpoint (``log`` is told so, and what the run starts
    from: the ``init`` weights where given, else scratch)."""
    if not resume:
        return None
    if isinstance(resume, Checkpoint):
        return resume
    if resume == "auto":
        path, ck = find_resumable(out_dir, log)
        if path is None and log:
            start = f"starting from the --init weights {init}" if init else \
                "starting from scratch"
            log(f"no checkpoint in {out_dir}; {start}")
        return ck
    return load_checkpoint(resume)


def remove_stale_temp_files(out_dir):
    """Delete the temporary files (``_TMP_RE``: ``*.h5.tmp.<pid>``,
    ``memory.json.tmp.<pid>``, ``metrics.jsonl.resumed.<pid>``, ...) left in
    ``out_dir`` by writers that were killed mid-write (their process is
    gone). Returns the removed paths. Before, only the checkpoints' were
    removed: each resumed run killed before its first checkpoint left one
    more ``metrics.jsonl.resumed.<pid>`` (a copy of the rows) for good."""
    if not os.path.isdir(out_dir):
        return []
    removed = []
    for name in os.listdir(out_dir):
        m = _TMP_RE.match(name)
        pid = m and int(m.group(1) or m.group(2))
        if not m or pid == os.getpid() or _alive(pid):
            continue
        try:
            os.remove(os.path.join(out_dir, name))
            removed.append(os.path.join(out_dir, name))
        except FileNotFoundError:
            pass
    return removed


#: a calibration run's folder (tools/choose._measure: ``.calibration-<key>-<pid>``,
#: ``-small`` for its second run), beside the calibration file: the run
#: folder's under ``parallel.scheme: auto``
_CALIBRATION_RE = re.compile(r"^\.calibration-[0-9a-f]+-(\d+)(?:-small)?$")


def remove_stale_calibration_folders(folder):
    """Delete the calibration runs' folders (``_CALIBRATION_RE``) left in
    ``folder`` by a process killed while it calibrated (kill -9, the OOM
    killer; a signal it is sent ends the run and removes them): its pid is
    gone and no process holds the folder's run lock (the calibration run's
    own ``.purine.lock``: a child still running keeps it). Returns the
    removed paths. Before, such a folder (the one-rank run's config,
    metrics, trace and log) stayed in the run folder for good, hidden."""
    import fcntl
    if not os.path.isdir(folder):
        return []
    removed = []
    for name in sorted(os.listdir(folder)):
        m = _CALIBRATION_RE.match(name)
        path = os.path.join(folder, name)
        if not m or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))) \
                or os.path.islink(path) or not os.path.isdir(path):
            continue
        lock = os.path.join(path, ".purine.lock")
        try:
            if os.path.lexists(lock):
                fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a run goes on there
                finally:
                    os.close(fd)  # (closing releases it)
            shutil.rmtree(path)
            removed.append(path)
        except OSError:
            continue
    return removed


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True



