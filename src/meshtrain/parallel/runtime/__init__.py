"""The runtime: the parallel plan, gradient synchronisation (replicated, ZeRO), the optimizer,
pipeline execution and schedules.
"""
