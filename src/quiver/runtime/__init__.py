"""Runtime: contexts, graphs, tensors, graph switching."""
