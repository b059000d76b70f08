"""The training loop every rank runs, and what it reports (metrics, plots, pipeline timelines)."""
