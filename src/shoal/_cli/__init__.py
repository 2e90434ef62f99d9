"""Command modules of the ``shoal`` CLI; each exposes ``register(subparsers)``."""
