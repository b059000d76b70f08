"""Running for real: exit codes and how runs end, graceful stop, the run lock, the hang watchdog
and `meshtrain doctor`.
"""
