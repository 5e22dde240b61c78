"""The training side of dlx-node: model, data, pipeline stages, the DiLoCoX engine and codec (no libp2p, no
chain)."""
