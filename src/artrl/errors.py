"""The project's own error types.

Every error raised on bad user input is an `ArtrlError`, so callers (and the
property-based tests) can tell a refused input from a bug. Messages name the
offending item (trajectory, field, value) and say what to do instead.
"""

from __future__ import annotations


class ArtrlError(Exception):
    """Base class of every error artrl raises on purpose."""


class TrajectoryError(ArtrlError, ValueError):
    """A trajectory or group is malformed (bad reward, role, tool call, logprobs...)."""


class ConfigError(ArtrlError, ValueError):
    """A configuration value, or a combination of values, cannot be honoured."""


class PackingError(ArtrlError, ValueError):
    """Tokenized data cannot be laid out into rows as asked (e.g. a trajectory too long)."""


class CheckpointError(ArtrlError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or belongs to another base model."""


class NonFiniteError(ArtrlError, FloatingPointError):
    """Every optimizer step of a train call had a NaN/inf loss or gradient: nothing was trained or saved.

    A call where only some steps were non-finite refuses those steps, counts them
    (`train/skipped_nonfinite_steps`) and logs an error instead of raising.
    """


class WorkerError(ArtrlError, RuntimeError):
    """A training worker process died or failed (killed, out of memory, a collective timed out).

    The message names the rank, how it ended, and what the train call left behind:
    no checkpoint of the failed step; the next train call restarts the workers from
    the latest complete checkpoint.
    """


class TrainOutOfMemoryError(ArtrlError, RuntimeError):
    """A train call ran out of device memory half-way.

    The adapter weights and optimizer state are put back as they were before the call
    (the last checkpoint's), so the checkpoint, the history and the served model are
    unchanged; the message says which setting to lower (max_tokens_per_microbatch,
    per_device_train_batch_size, row_length, gradient checkpointing).
    """


class TrainTooLongError(TrainOutOfMemoryError):
    """A train call refused before it trained anything: its longest micro-batch fits the device's free memory under
    no setting the call may choose (activation checkpointing, offloading on a GPU), by the memory plan.

    `tokens`: the micro-batch's tokens; `fit`: the most that fit. Nothing changed: no step, no checkpoint.
    """

    def __init__(self, message: str, *, tokens: int = 0, fit: int = 0) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.fit = fit


class ImageError(TrajectoryError):
    """An image in a message cannot be used: it does not decode, is too large, comes from a place that is not
    allowed (a file outside allowed_local_media_path, a URL that cannot be fetched), or the model has no vision
    tower. The message names the content part (artrl/chat/images.py); the server answers it with 400."""


class LocalServingUnavailableError(ArtrlError, RuntimeError):
    """ART's name (art.LocalServingUnavailableError): the inference server a training run relies on cannot be
    reached, so training must stop rather than count its rollouts as failed. A RuntimeError, as in ART."""
