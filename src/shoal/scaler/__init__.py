"""Lag and scaling: the pipeline monitor (exact lag), policies (pure), backends (local, Kubernetes).

Imports ``schemas``, ``broker`` settings and the pipeline spec, no processing code; the runtime that
wires them to a broker lives in ``shoal.runtime.scaler``.
"""
