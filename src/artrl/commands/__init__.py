"""What `artrl X` runs (cli.py maps each command to its module here), apart from the library it drives.

    demo.py           `artrl demo`: SFT warm-up then RL on the tiny model; demo_pipeline.py `artrl demo --pipeline`
    serve.py          `artrl serve`: the OpenAI-compatible server alone, on any engine
    runs.py           `artrl runs show`: a run's rewards and losses per step (told apart from run/, the run directory)
    bench/            `artrl bench pack|train|serve|memory`: measure your own setup, one JSON line each

Empty on purpose: `artrl --help` and `artrl runs show` import no torch (tests/test_import_cost.py).
"""
