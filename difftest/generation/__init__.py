"""Where a run's cases come from: the pinned corpus, Hypothesis strategies, the covering schedule,
the dense family, capability fitting."""
