"""Benchmarks: throughput, and the mutation benchmark (detection power)."""
