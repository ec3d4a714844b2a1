"""Case generation: Hypothesis strategies and the pinned regression corpus."""
