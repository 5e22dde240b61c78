"""What a node has before any part, knows and keeps: its base (config, identity, books), the lane, the round
book, per-round state and clock, its station, the run's topology, what it signed, its status."""
