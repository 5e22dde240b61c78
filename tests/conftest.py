"""Shared pytest configuration. Fixture plugins of each area are listed here; append, do not rewrite."""

pytest_plugins = ["ledger_fixtures", "node_fixtures", "torch_fixtures"]
