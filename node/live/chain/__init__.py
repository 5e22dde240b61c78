"""The chain side of a round: the node's view of the ledger, signing and committing records, reading them back, healing a fork."""
