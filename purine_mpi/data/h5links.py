"""HDF5 files that reach outside themselves, and files another process holds.

An HDF5 file can keep a dataset's bytes in other files: external storage
(``Dataset.external``: raw bytes at an offset of any file, ``/etc/passwd``
included), external links (``h5py.ExternalLink``: a name resolved in
another HDF5 file), virtual datasets (``Dataset.is_virtual``: a view of
datasets of other files, which reads as fill values, zeros, where a source
file is missing). A soft link may also point nowhere, or through an
external link. Checkpoints and weights files must be self-contained
(``outside_reference`` walks a whole file and names the first such
object); data files may use them where the data spec says ``external:
true``, and then ``check_sources`` makes sure every file they read exists
and is large enough (never zeros in place of a missing file).

``held_by`` says which process holds a file open when HDF5's file lock
refuses it (errno 11): a held file is not a damaged one.
"""
import errno
import os
import posixpath

import numpy as np

from ..base.errors import UserError, one_line

#: how many soft links in a row are followed when checking where one leads
_MAX_SOFT_DEPTH = 16


# ------------------------------------------------------------- what points out
def _dataset_outside(dset):
    """What a dataset reads from outside its file (text), or None."""
    if dset.is_virtual:
        files = []
        for source in dset.virtual_sources():
            name = source.file_name
            shown = "this file" if name == "." else f"'{name}'"
            if shown not in files:
                files.append(shown)
        return f"a virtual dataset reading from {', '.join(files)}"
    external = dset.external
    if external:
        files = []
        for name, _, _ in external:
            name = os.fsdecode(name)
            if name not in files:
                files.append(name)
        return f"stored in external file(s) {', '.join(repr(n) for n in files)}"
    return None


def _resolve_soft(f, parent, target, depth=0, shown=None):
    """Where a soft link in group ``parent`` to ``target`` (bytes, as HDF5
    keeps them: a name that is not UTF-8 too) leads: None if to an object
    of the file through hard links only, else a text saying why not
    (dangling, or through an external link). Never opens another file."""
    import h5py
    shown = shown or target
    if depth > _MAX_SOFT_DEPTH:
        return f"a soft link to '{_name(shown)}' that goes round in circles"
    path = target if target.startswith(b"/") else posixpath.join(parent or b"/", target)
    # HDF5 skips "." and empty components but takes ".." as a name like any
    # other (a link named "..", not the parent: "../x" is dangling where the
    # group holds no link of that name), so it is looked up as such here
    group, parts = b"/", [p for p in path.split(b"/") if p and p != b"."]
    for i, part in enumerate(parts):
        here = h5py.h5o.open(f.id, group)
        if not isinstance(here, h5py.h5g.GroupID) or not here.links.exists(part):
            return f"a dangling soft link to '{_name(shown)}' (nothing is there)"
        kind = here.links.get_info(part).type
        name = posixpath.join(group, part)
        if kind == h5py.h5l.TYPE_EXTERNAL:
            file, where = here.links.get_val(part)
            return (f"a soft link to '{_name(shown)}' through the external link '{_name(name)}' "
                    f"to '{_name(where)}' in file '{_name(file)}'")
        if kind == h5py.h5l.TYPE_SOFT:
            to = here.links.get_val(part)
            why = _resolve_soft(f, group, to, depth + 1, shown)
            if why:
                return why
            rest = b"/".join(parts[i + 1:])
            return _resolve_soft(f, b"/", posixpath.join(to if to.startswith(b"/")
                                                         else posixpath.join(group, to),
                                                         rest), depth + 1, shown) if rest else None
        group = name
    return None


def link_outside(f, name):
    """What the link ``name`` (a full path of the open file ``f``, its
    parents hard links; text, or bytes for a name that is not UTF-8) points
    to outside the file, or None. Link values are read as HDF5 keeps them
    (bytes: h5py's SoftLink and ExternalLink show a value that is not
    UTF-8 as the text ``b'...'``, which names nothing)."""
    import h5py
    raw = name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape")
    parent, _, base = raw.rstrip(b"/").rpartition(b"/")
    parent = parent or b"/"
    group = h5py.h5o.open(f.id, parent)  # held: its LinkProxy does not keep it open
    links = group.links
    if not links.exists(base):
        return None
    kind = links.get_info(base).type
    if kind == h5py.h5l.TYPE_EXTERNAL:
        file, where = links.get_val(base)
        return f"an external link to '{_name(where)}' in file '{_name(file)}'"
    if kind == h5py.h5l.TYPE_SOFT:
        return _resolve_soft(f, parent, links.get_val(base))
    if kind != h5py.h5l.TYPE_HARD:  # a user-defined link: HDF5 resolves it, not this file
        return f"a link of HDF5's user-defined type {kind}"
    obj = f[raw]
    return _dataset_outside(obj) if isinstance(obj, h5py.Dataset) else None


def _name(name):
    """An HDF5 name as text: bytes that are not UTF-8 as surrogate escapes."""
    return name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name


def _reads_outside(dcpl):
    """Whether a dataset (its creation properties) may read from another
    file (virtual, or with external storage): a cheap check, with no h5py
    objects built."""
    import h5py
    return dcpl.get_layout() == h5py.h5d.VIRTUAL or dcpl.get_external_count() > 0


class Alias(tuple):
    """``outside_reference``'s entry for a second name of an object (a
    second hard link, or a soft link): ``target``, the object's first name
    in the walk (full, bytes; b"/" for the root), ``group`` whether it is a
    group, ``soft`` whether this name is a soft link."""
    __slots__ = ()

    def __new__(cls, target, group, soft):
        return super().__new__(cls, (target, group, soft))

    target = property(lambda self: self[0])
    group = property(lambda self: self[1])
    soft = property(lambda self: self[2])


def outside_reference(f, group="/", found=None):
    """(name, what) of the first object under ``group`` of the open h5py
    file ``f`` that reads from outside the file or does not resolve (an
    external link, a dangling soft link or one through an external link, a
    dataset with external storage, a virtual dataset), or None. Follows hard
    links only: no other file is opened. Walks the links with HDF5's own
    visit (each group once, every link: a group hard-linked into itself or
    into its own child ends the walk there), so that a file of many small
    datasets costs a cheap look at each; an object met again under a second
    hard link (its address, which the link's info gives) is not opened
    again. ``found``, a dict, receives the walk's by-product (inspect's
    listing, without a second walk), keyed by each name (bytes, below
    ``group``): for the first hard link to a dataset (opened DatasetID, its
    creation property list); for a second hard link to any object, and for
    each soft link, an ``Alias`` naming the object's first name (a soft
    link whose target the walk did not meet, one out of ``group``, None)."""
    import h5py
    start = f[group]
    prefix = start.name.rstrip("/").encode("utf-8", "surrogateescape")
    first = {h5py.h5o.get_info(start.id).addr: (prefix or b"/", True)}  # address: (name, group)
    bad, soft = [], []

    def visit(name, info):
        full = prefix + b"/" + name
        if info.type == h5py.h5l.TYPE_HARD:
            seen = first.get(info.u)
            if seen is not None:  # a second name: the object was looked at under its first
                if found is not None:
                    found[name] = Alias(seen[0], seen[1], False)
                return None
            oid = h5py.h5o.open(start.id, name)
            is_set = isinstance(oid, h5py.h5d.DatasetID)
            first[info.u] = full, not is_set
            if not is_set:
                return None
            dcpl = oid.get_create_plist()
            if found is not None:
                found[name] = oid, dcpl
            if not _reads_outside(dcpl):
                return None
        elif info.type == h5py.h5l.TYPE_SOFT and found is not None:
            found[name] = None
            soft.append(name)
        why = link_outside(f, full)
        if why:
            bad.append((_name(full), why))
            return True
        return None
    start.id.links.visit(visit, info=True)
    if bad:
        return bad[0]
    for name in soft:  # each resolves inside the file (checked above): to what first name
        seen = first.get(h5py.h5o.get_info(h5py.h5o.open(start.id, name)).addr)
        if seen is not None:
            found[name] = Alias(seen[0], seen[1], True)
    return None


def refuse_outside(f, path, what, found=None):
    """Raise a UserError naming the first object of ``f`` that reads from
    outside the file (see ``outside_reference``, which fills ``found``)."""
    bad = outside_reference(f, found=found)
    if bad:
        name, why = bad
        raise UserError(f"{what} '{path}': '{one_line(name)}' is {one_line(why)}; checkpoint "
                        "and weights files must hold their own data (external storage, external links and "
                        "virtual datasets are refused): write the values into the file itself")


# --------------------------------------------------- the files a dataset reads
def _find(name, folders):
    if os.path.isabs(name):
        return name if os.path.exists(name) else None
    for folder in folders:
        candidate = os.path.join(folder, name)
        if os.path.exists(candidate):
            return candidate
    return None


def check_sources(dset, path, where):
    """For a data file whose spec allows ``external: true``: every file the
    dataset ``dset`` (``where``: its name) reads exists, is readable and is
    large enough; a UserError naming it otherwise (HDF5 would read zeros in
    place of a missing virtual source)."""
    import h5py
    home = os.path.dirname(os.path.abspath(path))
    if dset.is_virtual:
        for source in dset.virtual_sources():
            if source.file_name == ".":
                if source.dset_name not in dset.file:
                    raise UserError(f"data file '{path}': virtual dataset '{where}' reads "
                                    f"'{source.dset_name}' of the same file, which has none")
                continue
            found = _find(source.file_name, [home, os.getcwd()])
            if found is None:
                raise UserError(f"data file '{path}': virtual dataset '{where}' reads from "
                                f"'{source.file_name}', which does not exist (HDF5 would read "
                                "zeros in its place)")
            try:
                with h5py.File(found, "r") as src:
                    ok = source.dset_name in src and isinstance(src[source.dset_name],
                                                                h5py.Dataset)
            except OSError as e:
                raise UserError(f"data file '{path}': virtual dataset '{where}' reads from "
                                f"'{found}', which cannot be opened as HDF5 ({e})") from None
            if not ok:
                raise UserError(f"data file '{path}': virtual dataset '{where}' reads "
                                f"'{source.dset_name}' of '{found}', which has no such dataset")
        return
    external = dset.external
    if not external:
        return
    remaining = int(np.prod(dset.shape, dtype=np.int64)) * dset.dtype.itemsize
    for name, offset, size in external:
        if remaining <= 0:
            break
        name = os.fsdecode(name)
        take = min(int(size), remaining)
        found = _find(name, [os.getcwd()])
        if found is None or not os.access(found, os.R_OK):
            raise UserError(f"data file '{path}': dataset '{where}' is stored in external file "
                            f"'{name}', which does not exist or cannot be read")
        have = os.path.getsize(found)
        if have < int(offset) + take:
            raise UserError(f"data file '{path}': dataset '{where}' needs bytes "
                            f"[{offset}, {int(offset) + take}) of external file '{name}', "
                            f"which has {have} bytes")
        remaining -= take


# ------------------------------------------------------------- held files
def is_lock_error(exc):
    """True when h5py refused to open a file because another process holds
    it (HDF5's file lock, errno 11, or a file already open for writing)."""
    text = str(exc)
    return getattr(exc, "errno", None) in (errno.EAGAIN, errno.EWOULDBLOCK) or \
        "unable to lock file" in text or "already open for write" in text


def held_by(path):
    """Who holds ``path`` locked: 'pid N (command)' for each process that
    /proc/locks lists on the file (Linux), or ''."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    holders = []
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        try:
            pid, dev = int(fields[4]), fields[5]
            inode = int(dev.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            continue
        if inode != st.st_ino or pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as c:
                command = c.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            command = ""
        text = f"pid {pid}" + (f" ({command[:80]})" if command else "")
        if text not in holders:
            holders.append(text)
    return ", ".join(holders)
