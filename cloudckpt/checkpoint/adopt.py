"""Moved to :mod:`cloudckpt.ops.adopt`; this name stays for scripts that import
``cloudckpt.checkpoint.adopt.adopt`` as the 0.1.0 docs showed."""

from ..ops.adopt import AdoptReport, adopt

__all__ = ["AdoptReport", "adopt"]
