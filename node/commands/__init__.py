"""The command faces of dlx-node: what each subcommand does (the argument parsers are node.commands.parsers';
exit codes live in node.cli)."""
