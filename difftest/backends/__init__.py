"""Backends under test: one module per kernel adapter, registered by entry point."""
