"""Tools over graphs, traces, checkpoints and docs: bench, plot, predict and the
scaling predictor, the graph and inspect commands, docgen, model formats."""
