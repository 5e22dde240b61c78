"""Offline tools over a run's public record: audit, pull, and the audit report."""
