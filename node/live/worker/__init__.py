"""The training side of a node: the stages it holds, the worker that trains them, and the per-round work off
the training thread."""
