"""One module per ``fusion`` subcommand."""
