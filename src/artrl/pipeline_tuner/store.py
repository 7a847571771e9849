"""Where tuner profiles live (ART's `PipelineTunerProfileStore`): `<run dir>/pipeline_tuner/<name>.json`, or a
path given as such (absolute, or ending in .json). Written atomically (temp file + rename), read and checked
with the profile's schema (config.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..run import storage
from .config import PipelineAutotunerProfile

PROFILE_DIR = "pipeline_tuner"
DEFAULT_PROFILE = "latest"


class PipelineTunerProfileStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @classmethod
    def for_model(cls, model: Any) -> "PipelineTunerProfileStore":
        return cls(Path(model._get_output_dir()) / PROFILE_DIR)

    def resolve(self, profile: str | None) -> Path:
        name = profile or DEFAULT_PROFILE
        path = Path(name)
        if path.is_absolute() or path.suffix == ".json":
            return path
        return self.root / f"{name}.json"

    def load(self, profile: str | None) -> PipelineAutotunerProfile:
        path = self.resolve(profile)
        if not path.is_file():
            raise ConfigError(f"PipelineAutotuneConfig(profile={profile!r}): no tuner profile at {path}. A run with "
                              "mode='online' writes one there (output_name, default 'latest').")
        return PipelineAutotunerProfile.model_validate_json(path.read_text(encoding="utf-8"))

    def save(self, profile: str, data: PipelineAutotunerProfile) -> Path:
        path = self.resolve(profile)
        path.parent.mkdir(parents=True, exist_ok=True)
        storage.write_json_atomic(path, json.loads(data.model_dump_json()))
        return path
