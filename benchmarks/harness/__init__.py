"""The development benchmarks behind `python benchmarks/bench.py learn|pipeline|replicas` (benchmarks/bench.py says
what each measures), and the tiny model primed for ART's pipeline examples (primed_tiny.py). They import artrl as a
user's program does, and each other relatively."""
