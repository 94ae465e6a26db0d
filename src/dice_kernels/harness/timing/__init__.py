"""Measurement: the timed loop (loop.py), its statistics (stats.py), the cache flush before each call, the
speed-of-light bounds, the machine a run measures on (platform.py) and the cached reference baselines."""
