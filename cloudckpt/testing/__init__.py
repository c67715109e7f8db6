"""Helpers for tests, benchmarks and the demo: real local stores on 127.0.0.1."""
