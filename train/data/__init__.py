"""The data path of training: the epoch plan, the streaming loader (with live mode's windows over a growing
cache and the quarantine of corrupt parts), its ordered reader pool and the batch layout."""
