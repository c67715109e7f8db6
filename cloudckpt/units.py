"""Binary byte units, defined once: ``64 * MiB``. Imports nothing, so any module may use it."""

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

__all__ = ["KiB", "MiB", "GiB", "TiB"]
