"""Running a graph: dispatchers, workspace, traces, stop signals."""
