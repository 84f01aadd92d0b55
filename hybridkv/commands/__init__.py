"""One module per ``hybridkv`` subcommand."""
