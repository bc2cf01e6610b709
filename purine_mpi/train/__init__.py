"""The training loop's services: habits the loop calls at fixed points of
a run (after a test pass, at a checkpoint), each a small class of its own,
so a new habit is a new service, not an edit of the iteration.
"""
