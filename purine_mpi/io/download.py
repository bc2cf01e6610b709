"""Fetch a public data set's official archive, verify it, unpack it: what
``data cifar10 --download`` does before converting (io/datasets.py), as
torchvision's ``download=True`` and Caffe's ``get_cifar10.sh`` do.

The archive goes to a temporary name beside its destination and is renamed
only once its MD5 matches, so an interrupted or corrupted download is never
taken for the data set; an archive already there with the right MD5 is not
fetched again. Only the ``data`` command downloads: training never does.
``PURINE_CIFAR10_URL`` replaces the official address (a mirror, or the
tests' local server).

Layer: job (docs/DESIGN.md); may import the foundation, devices, data, ops and
graph layers below it, and its own.
"""
import hashlib
import os
import shutil
import tarfile
import urllib.error
import urllib.request

from .. import env
from ..errors import UserError
from ..progress import progress

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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
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
                        f"its folder with --from") from None
    got = md5_of(tmp)
    if got != md5:
        _remove(tmp)
        raise UserError(f"{url}: the download's MD5 is {got}, expected {md5} (a truncated "
                        "or altered file); nothing was kept, run the command again")
    os.replace(tmp, path)
    log(f"downloaded {url} to {path} (MD5 {md5})")
    return path


def unpack(archive, folder):
    """Extract a .tar.gz into ``folder`` (members outside it are refused)."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            root = os.path.realpath(folder)
            for member in tar.getmembers():
                target = os.path.realpath(os.path.join(folder, member.name))
                if not (target == root or target.startswith(root + os.sep)) or \
                        member.issym() or member.islnk():
                    raise UserError(f"{archive}: member '{member.name}' would be written "
                                    "outside the folder; refused")
            tar.extractall(folder)
    except (tarfile.TarError, OSError) as exc:
        raise UserError(f"{archive}: not a readable .tar.gz ({exc})") from None
    return folder


def download_cifar10(cache_dir, log=None):
    """The folder of CIFAR-10's python batches under ``cache_dir``, fetched
    and verified if needed (``PURINE_CIFAR10_URL``, ``PURINE_CIFAR10_MD5``
    replace the official address and checksum)."""
    url = env.get("PURINE_CIFAR10_URL") or CIFAR10_URL
    md5 = env.get("PURINE_CIFAR10_MD5") or CIFAR10_MD5
    archive = fetch(url, os.path.join(cache_dir, os.path.basename(url) or "cifar10.tar.gz"),
                    md5, log)
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
