"""What every rank of a run must start from alike (docs/failures.md, "The
start-up agreement"): the resolved config, the ``--init`` weights file and
``--init-skip``, the checkpoint ``--resume`` continues from and its
iteration, and the data files. ``run_inputs`` lists this rank's
``(name, key, description)`` in a fixed order; ``World.check_agreed``
compares the keys across ranks in one allgather before anything is built.

A key is a digest of the content, never of a path or a time (the same file
may sit at another path or carry another mtime on another host):

    the config           sha256 of its resolved YAML text
    --init               sha256 of the file's bytes
    --resume             its iteration and the sha256 of what it holds
                         (checkpoint_file.state_digest of /params, /solver,
                         /state), computed from the checkpoint as read
    a data file          its size and the sha256 of its bytes up to
                         ``WHOLE_UP_TO``; above, of ``BLOCKS`` blocks of
                         ``BLOCK`` bytes spread evenly over it (the first
                         and the last included): a bounded read, whatever
                         the size
"""
import hashlib
import os

#: a data file up to this size is hashed whole; a larger one is sampled
WHOLE_UP_TO = 64 << 20
BLOCKS, BLOCK = 64, 64 << 10


def file_sha256(path):
    """sha256 (hex) of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def data_file_digest(path):
    """(key, description) of a data file: its size and the sha256 of its
    bytes, whole up to ``WHOLE_UP_TO``, else of ``BLOCKS`` evenly spread
    blocks; ("not found", ...) when it cannot be read."""
    try:
        size = os.path.getsize(path)
        if size <= WHOLE_UP_TO:
            digest, how = file_sha256(path), "sha256"
        else:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for i in range(BLOCKS):
                    f.seek((size - BLOCK) * i // (BLOCKS - 1))
                    h.update(f.read(BLOCK))
            digest, how = h.hexdigest(), f"sha256 of {BLOCKS} blocks"
    except OSError as e:
        return "not found", f"'{path}' cannot be read ({e.strerror or e})"
    return f"{size}:{digest}", f"'{path}' {size} bytes, {how} {digest[:16]}"


def data_files(job):
    """[(name, path)] of the files the job's data splits read, in the
    config's order: an hdf5 or text source's file, an lmdb's data.mdb, a
    mean_file."""
    out = []
    for phase, spec in job.data.items():
        if spec.source in ("hdf5", "text") and spec.path:
            out.append((f"data.{phase}.path", spec.path))
        elif spec.source == "lmdb" and spec.path:
            out.append((f"data.{phase}.path", os.path.join(spec.path, "data.mdb")))
        if getattr(spec, "mean_file", None):
            out.append((f"data.{phase}.mean_file", spec.mean_file))
    return out


def run_inputs(config_text, job, init=None, init_skip=(), resumed=None):
    """This rank's ``[(name, key, description)]`` of what shapes the run, in
    a fixed order. ``resumed``: the Checkpoint ``--resume`` resolved to
    (job/run_checkpoints.resolve_resume), or None."""
    from .checkpoint_file import state_digest
    config = hashlib.sha256(config_text.encode()).hexdigest()
    out = [("resolved configuration", config, f"sha256 {config[:16]}")]
    if not init:
        out.append(("--init", None, "none"))
    elif os.path.isfile(init):
        digest = file_sha256(init)
        out.append(("--init", digest, f"'{init}' sha256 {digest[:16]}"))
    else:
        out.append(("--init", "not found", f"'{init}' not found"))
    skip = ", ".join(sorted(init_skip or ())) or None
    out.append(("--init-skip", skip, skip or "none"))
    if resumed is None:
        out.append(("--resume", None, "none (starting from scratch)"))
    else:
        digest = state_digest({"params": resumed.params, "solver": resumed.solver,
                               "state": resumed.state})
        out.append(("--resume", f"{resumed.iteration}:{digest}",
                    f"'{resumed.path}' at iteration {resumed.iteration}, content sha256 "
                    f"{digest[:16]}"))
    for name, path in data_files(job):
        out.append((name, *data_file_digest(path)))
    return out
