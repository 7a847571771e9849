"""ART's `art.pipeline_tuner`: the configs of a pipelined run and the tuner's records (config.py), the online
tuner (autotune.py) and its saved profiles (store.py); docs/pipeline.md, "The online tuner"."""

from .autotune import PipelineAutotuner, StepMeasurement
from .config import (PipelineAutotuneConfig, PipelineAutotunerProfile, PipelineRuntimeConfig, PipelineTuneSettings,
                     TunerDecision, TunerWindowStats)
from .store import PipelineTunerProfileStore

__all__ = ["PipelineAutotuneConfig", "PipelineAutotuner", "PipelineAutotunerProfile", "PipelineRuntimeConfig",
           "PipelineTuneSettings", "PipelineTunerProfileStore", "StepMeasurement", "TunerDecision",
           "TunerWindowStats"]
