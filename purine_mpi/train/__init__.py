"""The training loop's services: habits the loop calls at fixed points of
a run (after a test pass, at a checkpoint), each a small class of its own,
so a new habit is a new service, not an edit of the iteration. Here too:
the trainer that assembles a rank's loop (``trainer``), the run's log
(``runlog``) and the parameter servers' loop (``ps_server``,
``async_server``).
"""
