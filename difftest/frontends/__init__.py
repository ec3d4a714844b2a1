"""Front ends other than the CLI entry: the active pytest plugin."""
