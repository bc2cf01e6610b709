"""``purine_mpi`` (its command line as ``python -m purine_mpi``) with the
cancel's least grace (``Cancel.CANCEL_GRACE``, 5 s) set from
PURINE_TEST_CANCEL_GRACE where that is set (tests/test_stall_cancel.py):
the tests' sleeps need only be longer than the grace, so a shorter grace
makes them shorter (CI time), with the same cases on either side of it.
The other test scripts of tests/test_stall_cancel.py call ``apply``."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def apply():
    from purine_mpi.base.cancel import Cancel
    grace = os.environ.get("PURINE_TEST_CANCEL_GRACE")
    if grace:
        Cancel.CANCEL_GRACE = float(grace)


if __name__ == "__main__":
    apply()
    from purine_mpi.cli import main
    sys.exit(main())
