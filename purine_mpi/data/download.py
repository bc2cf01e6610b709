"""Fetch a public data set's official archive, verify it, unpack it: what
``data cifar10 --download`` does before converting (data/datasets.py), as
torchvision's ``download=True`` and Caffe's ``get_cifar10.sh`` do.

The archive goes to a temporary name beside its destination and is renamed
only once its MD5 matches, so an interrupted or corrupted download is never
taken for the data set; an archive already there with the right MD5 is not
fetched again. Only the ``data`` command downloads: training never does.
``PURINE_CIFAR10_URL`` replaces the official address (a mirror, or the
tests' local server). A download that fails leaves nothing behind: the
partial file is removed, and so is the download folder when this run made
it. ``cifar10_from`` resolves ``data cifar10 --from``: the downloaded
``.tar.gz``, a folder holding it, or its unpacked folder. An archive is
unpacked with only regular files and folders allowed (a member with an
absolute path, a ``..`` or a link is refused; Python's ``filter='data'``
too where Python has it) into a temporary folder removed afterwards.
"""
import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request

from ..base import env
from ..base.errors import UserError
from ..base.progress_bar import progress
from ..base.runfiles import folder_of, missing_folders

#: the official archive of CIFAR-10's python version and its MD5
#: (https://www.cs.toronto.edu/~kriz/cifar.html)
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"


def md5_of(path, chunk=1 << 20):
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(url, path, md5, log=None, timeout=60):
    """Download ``url`` to ``path`` unless a file with ``md5`` is there;
    returns ``path``. A wrong checksum or a failed transfer is a UserError
    naming the address, and leaves no file at ``path``."""
    log = log or (lambda msg: None)
    if os.path.isfile(path) and md5_of(path) == md5:
        log(f"{path}: already downloaded (MD5 {md5})")
        return path
    # made as ``mkdir -p`` and the run folder's makedirs make it: each name
    # resolved by the system (``link/../new/file``: beside the link's target,
    # not lexically as abspath reads it), and a dangling link in the way
    # refused, never its target made (realpath would make it)
    folder = folder_of(path)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{folder}: cannot make this folder for the download "
                        f"({exc.strerror or exc})") from None
    tmp = f"{path}.part"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with progress(total or 0, "download", "B", log=log) as bar:
                for block in iter(lambda: response.read(1 << 20), b""):
                    out.write(block)
                    bar.update(len(block))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        _remove(tmp)
        raise UserError(f"could not download {url}: {exc}; download it by hand and pass "
                        f"the {os.path.basename(path)} file (or the folder holding it, or "
                        "the folder it unpacks to) with --from") from None
    got = md5_of(tmp)
    if got != md5:
        _remove(tmp)
        raise UserError(f"{url}: the download's MD5 is {got}, expected {md5} (a truncated "
                        "or altered file); nothing was kept, run the command again")
    os.replace(tmp, path)
    log(f"downloaded {url} to {path} (MD5 {md5})")
    return path


def unpack(archive, folder):
    """Extract a .tar.gz into ``folder``: only regular files and folders
    inside it; a member with an absolute path, a ``..``, a link or a device
    is refused before anything is written."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            root = os.path.realpath(folder)
            members = tar.getmembers()
            for member in members:
                parts = member.name.replace("\\", "/").split("/")
                target = os.path.realpath(os.path.join(folder, member.name))
                if os.path.isabs(member.name) or ".." in parts or \
                        not (target == root or target.startswith(root + os.sep)):
                    raise UserError(f"{archive}: member '{member.name}' would be written "
                                    "outside the folder; refused")
                if not (member.isfile() or member.isdir()):
                    raise UserError(f"{archive}: member '{member.name}' is a link or a "
                                    "special file; refused")
            if hasattr(tarfile, "data_filter"):
                tar.extractall(folder, members=members, filter="data")
            else:  # Python before 3.11.4 / 3.12: the checks above are the filter
                tar.extractall(folder, members=members)
    except (tarfile.TarError, OSError) as exc:
        # tarfile lists each compression it tried on a line of its own: one line here
        said = "; ".join(line.strip().lstrip("- ").rstrip(":") for line in str(exc).splitlines()
                         if line.strip())
        raise UserError(f"{archive}: not a readable .tar.gz ({said or type(exc).__name__})") \
            from None
    return folder


def _holds_batches(folder):
    return os.path.isfile(os.path.join(folder, "data_batch_1")) or \
        os.path.isdir(os.path.join(folder, "cifar-10-batches-py"))


@contextlib.contextmanager
def cifar10_from(source, scratch=None, log=None):
    """The folder of CIFAR-10's python batches that ``--from SOURCE`` names:
    the downloaded archive (``cifar-10-python.tar.gz``), a folder holding it
    (and no batches), or the unpacked folder (``cifar-10-batches-py`` or the
    folder above it). An archive is unpacked into a temporary folder under
    ``scratch`` (the system's temporary folder when None), removed when the
    block ends."""
    log = log or (lambda msg: None)
    archive = None
    if os.path.isfile(source):
        archive = source
    elif os.path.isdir(source) and not _holds_batches(source):
        names = sorted(n for n in os.listdir(source) if n.endswith((".tar.gz", ".tgz")))
        official = os.path.basename(CIFAR10_URL)
        if official in names or len(names) == 1:
            archive = os.path.join(source, official if official in names else names[0])
    if archive is None:
        yield source
        return
    staging = tempfile.mkdtemp(prefix=".cifar10-unpack-",
                               dir=scratch if scratch and os.path.isdir(scratch) else None)
    try:
        log(f"unpacking {archive}")
        unpack(archive, staging)
        found = os.path.join(staging, "cifar-10-batches-py")
        if not os.path.isdir(found):
            raise UserError(f"{archive}: no cifar-10-batches-py folder inside (the "
                            "CIFAR-10 python version's archive holds one)")
        yield found
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download_cifar10(cache_dir, log=None):
    """The folder of CIFAR-10's python batches under ``cache_dir``, fetched
    and verified if needed (``PURINE_CIFAR10_URL``, ``PURINE_CIFAR10_MD5``
    replace the official address and checksum)."""
    url = env.get("PURINE_CIFAR10_URL") or CIFAR10_URL
    md5 = env.get("PURINE_CIFAR10_MD5") or CIFAR10_MD5
    made = missing_folders(cache_dir)  # the folders as the system finds them
    try:
        archive = fetch(url, os.path.join(cache_dir, os.path.basename(url) or "cifar10.tar.gz"),
                        md5, log)
    except BaseException:
        for folder in made:  # the folders this run made, innermost first, if left empty
            try:
                os.rmdir(folder)
            except FileNotFoundError:
                continue  # not made: the transfer failed before (a folder refused)
            except OSError:
                break
        raise
    batches = os.path.join(cache_dir, "cifar-10-batches-py")
    if not os.path.isdir(batches):
        staging = os.path.join(cache_dir, ".unpack")
        shutil.rmtree(staging, ignore_errors=True)
        unpack(archive, staging)
        found = os.path.join(staging, "cifar-10-batches-py")
        if not os.path.isdir(found):
            shutil.rmtree(staging, ignore_errors=True)
            raise UserError(f"{archive}: no cifar-10-batches-py folder inside")
        os.replace(found, batches)
        shutil.rmtree(staging, ignore_errors=True)
    return batches


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass
