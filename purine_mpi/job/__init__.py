"""The job: its config (one declaration per key), the validated `Job`, the
graphs of one replica, and its files on disk: run folders, checkpoints, metrics."""
