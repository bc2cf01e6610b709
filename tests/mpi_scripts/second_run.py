"""``purine_mpi`` (its command line as ``python -m purine_mpi``) as a second
run of one process (tests/test_stall_cancel.py): the class-level state an
earlier run of this process leaves -- a Ctrl-C that stopped it 100 s ago
(``Cancel.cancelled``), waits being measured, a long wait seen -- is set
first, as the Python API's second ``run_training`` call finds it. Rank 1
then begins its first graph run PURINE_TEST_SLOW_S seconds late (a slow
start on a loaded node), so rank 0 waits that long for it: a healthy job."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from purine_mpi.runtime.dispatcher import Dispatcher  # noqa: E402
from purine_mpi.base.cancel import Cancel  # noqa: E402

SLOW = float(os.environ["PURINE_TEST_SLOW_S"])
RANK = int(os.environ.get("PMI_RANK", "0"))

Cancel.cancelled = ("SIGINT", time.monotonic() - 100.0)  # the earlier run's Ctrl-C
Cancel.measuring = True
Cancel.last_checkpoint = 7

if RANK == 1:
    _run, _first = Dispatcher.run, [True]

    def slow_first_run(self, *args, **kwargs):
        if _first[0]:
            _first[0] = False
            time.sleep(SLOW)
        return _run(self, *args, **kwargs)

    Dispatcher.run = slow_first_run

from tests.mpi_scripts import short_grace  # noqa: E402

short_grace.apply()  # PURINE_TEST_CANCEL_GRACE

if __name__ == "__main__":
    from purine_mpi.cli import main
    sys.exit(main())
