"""Benchmarks behind `artrl bench ...`: each prints one JSON line of figures."""
