"""Re-execution spot checks: which contributions a node re-runs, the inputs it gathers, the child process,
accusations and verdicts."""
