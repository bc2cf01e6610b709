"""``purine_mpi`` (its command line as ``python -m purine_mpi``) with rank 0
slow to write a checkpoint (tests/test_stall_cancel.py): after the first
pair of its first ``Streamed`` section (a sharded save's bucket, gathered
from every rank as its turn comes) rank 0 sleeps PURINE_TEST_SLOW_S seconds
(a slow file system), so the other ranks wait that long in the next
bucket's gather: a healthy job."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from purine_mpi.job import checkpoint_file  # noqa: E402

SLOW = float(os.environ["PURINE_TEST_SLOW_S"])

if int(os.environ.get("PMI_RANK", "0")) == 0:
    _items, _slept = checkpoint_file.Streamed.items, []

    def slow_items(self):
        for pair in _items(self):
            yield pair
            if not _slept:
                _slept.append(True)
                time.sleep(SLOW)  # writing it

    checkpoint_file.Streamed.items = slow_items

from tests.mpi_scripts import short_grace  # noqa: E402

short_grace.apply()  # PURINE_TEST_CANCEL_GRACE

if __name__ == "__main__":
    from purine_mpi.cli import main
    sys.exit(main())
