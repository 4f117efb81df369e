"""Tracing Python functions into Graph IR: annotations, traced tensors, the ops users call."""
