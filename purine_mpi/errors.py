"""Error types. A ``UserError`` is the user's to fix (bad config, missing file,
shape mismatch): the CLI prints its message as one paragraph and exits 2,
with no traceback. Anything else is a bug or a runtime failure.

Layer: foundation (docs/DESIGN.md); may import only its own layer (the bottom
one), the standard library and third-party packages.
"""

#: the exit status when MPI itself cannot start (MPI_Init fails: comm/mpi_init.py)
MPI_INIT_FAILED = 70


class UserError(Exception):
    """An error the user can act on; the message names the file/key/node."""

    exit_code = 2


class ConfigError(UserError):
    """Bad configuration: ``ConfigError(path, key, message)``."""

    def __init__(self, path, key, message):
        self.path, self.key = path, key
        where = f"{path}: " if path else ""
        keytxt = f"key '{key}': " if key else ""
        super().__init__(f"{where}{keytxt}{message}")


class GraphError(UserError):
    """An invalid graph: unknown op type, dangling input, cycle, double writer."""


class ShapeError(GraphError):
    """Shape inference failed; the message names the op and the blobs."""


class StallError(RuntimeError):
    """A communication op did not complete within the stall timeout."""


class OpError(RuntimeError):
    """An op's kernel raised; carries the op name so every rank can report it."""

    def __init__(self, op, cause, rank=0):
        self.op, self.cause, self.rank = op, cause, rank
        super().__init__(f"rank {rank}: op '{op.name}' ({op.op_type}) failed: "
                         f"{type(cause).__name__}: {cause}")
