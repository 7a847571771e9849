"""ART's path of the JSONL -> Parquet migration and ART's JSONL helpers (`art.utils.trajectory_migration`); they live
in run/migration.py, beside the run directory they migrate."""

from ..run.migration import (ESTIMATED_COMPRESSION, TRAJECTORIES_DIR, MigrationResult, auto_migrate_on_register,
                             deserialize_trajectory_groups, dict_to_history, dict_to_message_or_choice,
                             dict_to_trajectory, dict_to_trajectory_group, history_to_dict, message_or_choice_to_dict,
                             migrate_all_models, migrate_jsonl_to_parquet, migrate_model_dir, migrate_trajectories_dir,
                             read_trajectory_groups_jsonl, serialize_trajectory_groups, trajectory_group_to_dict,
                             trajectory_to_dict)

__all__ = [
    "ESTIMATED_COMPRESSION", "TRAJECTORIES_DIR", "MigrationResult", "auto_migrate_on_register",
    "deserialize_trajectory_groups", "dict_to_history", "dict_to_message_or_choice", "dict_to_trajectory",
    "dict_to_trajectory_group", "history_to_dict", "message_or_choice_to_dict", "migrate_all_models",
    "migrate_jsonl_to_parquet", "migrate_model_dir", "migrate_trajectories_dir", "read_trajectory_groups_jsonl",
    "serialize_trajectory_groups", "trajectory_group_to_dict", "trajectory_to_dict",
]
