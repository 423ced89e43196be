"""Continuous batching shared by the engines: per-request state and the step scheduler."""
