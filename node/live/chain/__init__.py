"""The node's view of the chain: one small adapter over ledger, and reading a commit back."""
