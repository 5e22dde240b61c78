"""The run's peers: placement and liveness, the heartbeat, the gossip inbox, what this node says and what it
signed before."""
