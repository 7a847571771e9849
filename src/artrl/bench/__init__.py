"""Benchmarks behind `artrl bench ...`: pack, train and serve print one JSON line of figures;
learn (learning per rollout, artrl against a plain GRPO step) prints a table and writes a JSON file."""
