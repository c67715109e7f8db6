"""The node-local tier (docs/local-tier.md)."""
