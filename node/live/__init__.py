"""The live node: joins a run, trains its stages, exchanges, coordinates rounds, commits."""
