"""The scaling predictor (``predict TRACE_DIR --np N``): how long an
iteration will take on N ranks, from a trace of a real run.

    link.py       the network model: α–β costs of the collectives and of
                  point-to-point transfers, link presets, the calibration file
    calibrate.py  ``predict --calibrate``: ping-pong and allreduce sweep under MPI,
                  and ranks sharing a host (kernels at once, a collective's wait)
    node.py       ranks sharing a node: the link file's ``node`` measurements
                  and the correction ``predict --ranks-per-node`` applies
    simulate.py   the dispatcher's scheduling core run over a virtual clock
    traces.py     reading ``trace.rank<R>.json``: per-op median durations
    model.py      from a run folder and N to the simulated ranks' graphs, the table
    work.py       an op's work (FLOPs, or the batch's bytes), to price an op
                  from a traced one of another size (``plan --choose``)
    report.py     the table as text or JSON, and the scaling curve (``--plot``)
    command.py    the ``predict`` command's forms told apart, and its options

It composes the graph a rank would run at N ranks, as ``graph --np N``
does (parallel/), and runs the scheduling core over it (runtime/); it
never imports the trainer (train/) or the CLI.
"""
