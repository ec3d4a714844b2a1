"""difftest pytest plugin."""
