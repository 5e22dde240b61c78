"""Networking for training rounds: a libp2p host, signed envelopes, gossip and content-addressed blobs
(knows nothing of torch or the chain)."""
