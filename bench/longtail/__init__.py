"""Pieces of bench/simulate_long_tail.py: workload, tables, simulator, oracle, policies, plot."""
