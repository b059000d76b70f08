"""The auto-parallel planner: hardware profiles, a cost model over layouts, and a search.

Pure computation: nothing here starts processes or touches torch.distributed (calibration, which
measures the machine, is the one exception and lives in `calibrate.py`).
"""
