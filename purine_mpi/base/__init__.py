"""The foundation: error types and exit statuses, the PURINE_* environment,
threads per rank, NumPy/CuPy selection, Philox, run files, progress bars."""
