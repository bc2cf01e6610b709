"""``purine_mpi`` (its command line as ``python -m purine_mpi``) with rank 1
slower than rank 0 (tests/test_stall_cancel.py): before each of its graph
iterations rank 1 sleeps PURINE_TEST_SLOW_S seconds (a long forward on a
slower node), so rank 0 waits that long in the iteration's communication
every time, a healthy job. Each sleep appends "<pid> <rank> <time.time()>"
to the file PURINE_TEST_SLOW_MARK as it begins (rank 0 once, at start)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from purine_mpi.runtime.dispatcher import Dispatcher  # noqa: E402

SLOW = float(os.environ["PURINE_TEST_SLOW_S"])
MARK = os.environ["PURINE_TEST_SLOW_MARK"]
RANK = int(os.environ.get("PMI_RANK", "0"))


def _mark():
    with open(MARK, "a") as f:
        f.write(f"{os.getpid()} {RANK} {time.time()}\n")


if RANK == 1:
    _run = Dispatcher.run

    def slow_run(self, *args, **kwargs):
        _mark()
        time.sleep(SLOW)  # a signal's handler runs, the sleep goes on (PEP 475)
        return _run(self, *args, **kwargs)

    Dispatcher.run = slow_run
else:
    _mark()

from tests.mpi_scripts import short_grace  # noqa: E402

short_grace.apply()  # PURINE_TEST_CANCEL_GRACE

if __name__ == "__main__":
    from purine_mpi.cli import main
    sys.exit(main())
