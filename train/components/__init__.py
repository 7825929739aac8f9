"""The pieces the training loop is built from: optimizer, spike guards, metrics, checkpoints and the state
they save, the run directory, signals, memory measurement and multi-node checks."""
