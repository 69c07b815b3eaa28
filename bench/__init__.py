"""Benchmarks of splitserve (run as modules, e.g. ``python -m bench.throughput``); not tests.

Kept light: importing ``bench`` imports neither torch nor the engine.
"""
