"""Parallel compositions: each turns one replica's training graph into the
graph a rank runs.

- ``compose``         the config's scheme -> this rank's graph (the trainer's entry)
- ``data_parallel``   synchronous data parallelism: gradient buckets + Allreduce
- ``param_server``    parameter servers, synchronous (sync_ps) or asynchronous
- ``model_parallel``  place layers on ranks and partition (pipelines)
"""
