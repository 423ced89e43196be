"""Tensor parallelism of the reference engine: the rank group and its collectives (`group`),
how a checkpoint is cut into shards (`shard`), and the ranks past the first, which follow
rank 0's steps in processes of their own (`mirror`, `follower`, `ranks`)."""
