"""Fault-injected backends: each wraps a correct backend and plants one bug of a known class."""
