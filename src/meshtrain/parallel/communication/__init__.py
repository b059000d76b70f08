"""Communication: every collective in `comm`, the differentiable region operators, the flight
recorder.
"""
