"""The command faces of dlx-node: what each subcommand does (parsing and exit codes live in node.cli)."""
