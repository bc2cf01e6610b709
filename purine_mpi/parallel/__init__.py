"""Parallel compositions: each turns one replica's training graph into the
graph a rank runs.

- ``schemes``         one ``Scheme`` per module and their registry: each scheme's
                      layout, composition (a ``Composition``), notes, start-up
                      lines, capabilities and checkpoint gather/split
- ``compose``         the config's scheme -> this rank's graph (the registry's
                      entry points: ``compose``, ``layout_of``, ...)
- ``data_parallel``   synchronous data parallelism: gradient buckets + Allreduce
- ``sharding``        ZeRO stage 1's pieces: a bucket's flat weights, the solver
                      over one shard, ReduceScatter + Allgather (no scheme yet)
- ``param_server``    the workers' and servers' graphs of a parameter-server run,
                      synchronous (sync_ps) or asynchronous (the servers' loop:
                      train/ps_server.py)
- ``model_parallel``  place layers on ranks and partition (pipelines)
- ``micro_batch``     micro-batch copies and the 1f1b / gpipe schedules
- ``partition``       a graph cut into per-rank parts joined by Send/Recv
- ``placement``, ``fuse``  a rank's graph placed on its device, fused for it
- ``rank_graphs``     the one function that builds a rank's graphs
"""
