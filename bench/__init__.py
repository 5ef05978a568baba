"""Benchmarks of agent-runtime (``python bench/run.py``; see docs/performance.md).

They print numbers (JSON and a table); they never assert timings.
"""
