"""``python -m purine_mpi``: see purine_mpi/cli.py. The threads per rank are
set by ``purine_mpi/__init__.py`` (purine_mpi/base/threads.py), which every entry
point imports first.
"""
import sys

if __name__ == "__main__":
    from .cli import main
    sys.exit(main())
