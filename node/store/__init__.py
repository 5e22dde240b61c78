"""What a node keeps on disk and serves: the round archive and checkpoints."""
