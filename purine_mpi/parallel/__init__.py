"""Parallel compositions: each turns one replica's training graph into the
graph a rank runs.

- ``compose``         the config's scheme -> this rank's graph (the trainer's entry);
                      the replicas x stages layout of pipeline and hybrid runs
- ``data_parallel``   synchronous data parallelism: gradient buckets + Allreduce
- ``param_server``    parameter servers, synchronous (sync_ps) or asynchronous
- ``model_parallel``  place layers on ranks and partition (pipelines)
- ``micro_batch``     micro-batch copies and the 1f1b / gpipe schedules
- ``pipeline_stats``  bubble, live micro-batches, stage overlap from trace events
"""
