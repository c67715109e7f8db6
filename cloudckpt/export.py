"""Moved to :mod:`cloudckpt.ops.export`; this name stays for scripts that import
``cloudckpt.export.export_weights`` as the 0.1.0 docs showed."""

from .ops.export import export_weights, read_dcp_metadata, read_dcp_state

__all__ = ["export_weights", "read_dcp_metadata", "read_dcp_state"]
