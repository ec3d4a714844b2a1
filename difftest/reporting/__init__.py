"""The run report, the bump gate between two reports, plots."""
