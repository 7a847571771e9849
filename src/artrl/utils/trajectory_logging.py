"""ART's path of the Parquet trajectory logs (`art.utils.trajectory_logging`); they live in run/trajectory_logs.py,
beside the run directory they are written into."""

from ..run.trajectory_logs import (COLUMNS, COMPRESSION, FORMAT_VERSION, MIGRATED_METADATA_KEY, MOE_ROUTING_KEY,
                                   V1_ART_COLUMNS, V1_EXTRA_COLUMNS, VERSION_METADATA_KEY,
                                   append_trajectory_groups_parquet, file_version, flatten_message, group_data,
                                   messages_column, migrated_sources, read_trajectory_groups_parquet, rows_of, schema, trajectory_data,
                                   unflatten_message, write_trajectory_groups_parquet)

__all__ = [
    "COLUMNS", "COMPRESSION", "FORMAT_VERSION", "MIGRATED_METADATA_KEY", "MOE_ROUTING_KEY", "V1_ART_COLUMNS",
    "V1_EXTRA_COLUMNS",
    "VERSION_METADATA_KEY",
    "append_trajectory_groups_parquet", "file_version", "flatten_message", "group_data", "messages_column",
    "migrated_sources", "read_trajectory_groups_parquet", "rows_of", "schema", "trajectory_data", "unflatten_message",
    "write_trajectory_groups_parquet",
]
