"""Commands around training: estimate, evaluate, sample, export and report."""
