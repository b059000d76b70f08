"""Pipeline schedules: each an object (`schedule.PipelineSchedule`) in one list
(`catalog.SCHEDULES`) with its action lists, and the simulator that replays them on costs.
"""
