"""Composition roots: worker, combiner, scaler, ``shoal up``. Imported only by the CLI and tests.

They own the I/O (MQTT sessions, checkpoint files, timers) around the pure cores in
``shoal.processors``.
"""
