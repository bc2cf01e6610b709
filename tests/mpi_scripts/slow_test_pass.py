"""``purine_mpi`` (its command line as ``python -m purine_mpi``) with rank 0
slow in its first test pass (tests/test_stall_cancel.py): before its first
test batch rank 0 appends "<time.time()>" to PURINE_TEST_SLOW_MARK, then
sleeps PURINE_TEST_SLOW_S seconds (a long test split). Under scheme none
rank 0 runs the pass alone and the other ranks wait for its figures: a
healthy job."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from purine_mpi.train import evaluation  # noqa: E402

SLOW = float(os.environ["PURINE_TEST_SLOW_S"])
MARK = os.environ["PURINE_TEST_SLOW_MARK"]

if int(os.environ.get("PMI_RANK", "0")) == 0:
    _share, _slept = evaluation.give_test_weights, []

    def slow_first_pass(loop):
        _share(loop)
        if not _slept:
            _slept.append(True)
            with open(MARK, "a") as f:
                f.write(f"{time.time()}\n")
            time.sleep(SLOW)  # the pass's batches
    evaluation.give_test_weights = slow_first_pass

from tests.mpi_scripts import short_grace  # noqa: E402

short_grace.apply()  # PURINE_TEST_CANCEL_GRACE

if __name__ == "__main__":
    from purine_mpi.cli import main
    sys.exit(main())
