"""Offline tools over a run's public record: audit, pull, the evidence both use, and the audit report."""
