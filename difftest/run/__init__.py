"""Orchestration: one case through every backend, sessions, a run's plan, jobs, shards, replays."""
