"""Harnesses that let tests and benchmarks stand in for hardware this machine does not have."""
