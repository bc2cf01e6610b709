"""``python -m purine_mpi``: see purine_mpi/cli.py. The threads per rank are
set by ``purine_mpi/__init__.py`` (purine_mpi/threads.py), which every entry
point imports first.

Layer: cli (docs/DESIGN.md); may import the foundation, devices, data, ops,
graph, job, composition, dispatch and services layers below it, and its own.
"""
import sys

if __name__ == "__main__":
    from .cli import main
    sys.exit(main())
