"""Load generation and benchmarks: synthetic sensors, the simulator, the bench commands.

Composition roots here are imported only by the CLI (and tests).
"""
