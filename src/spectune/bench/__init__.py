"""Benchmarks: side-by-side measurement and the report."""
