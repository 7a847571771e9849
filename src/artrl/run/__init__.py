"""The run directory: what a model's run leaves on disk, below every backend and session.

    storage.py     the layout (written down once), atomic writes, checkpoint directories
    checkpoint.py  a trainer's checkpoint: saved and restored
    history.py     history.jsonl rows, the trajectory logs, the best logged step
    tracking.py    history rows mirrored to W&B or TensorBoard
    trajectory_logs.py  the trajectory logs as Parquet, ART's format (ART's path: artrl.utils.trajectory_logging)
    migration.py   JSONL trajectory logs -> Parquet at register (ART's path: artrl.utils.trajectory_migration)

It imports nothing of local/, distributed/ or model.py (tests/test_layers.py).
"""
