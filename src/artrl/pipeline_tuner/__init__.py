"""ART's `art.pipeline_tuner`: the configs of a pipelined run (config.py). ART's online tuner and its
profile files are not built; `PipelineTrainer` refuses autotune modes other than "off" (docs/pipeline.md)."""

from .config import PipelineAutotuneConfig, PipelineRuntimeConfig

__all__ = ["PipelineAutotuneConfig", "PipelineRuntimeConfig"]
