"""Reward functions (ART's `art.rewards`): RULER, an LLM judge that ranks a group's trajectories."""

from .ruler import DEFAULT_RUBRIC, JudgeError, TrajectoryScore, ruler, ruler_score_group

__all__ = ["DEFAULT_RUBRIC", "JudgeError", "TrajectoryScore", "ruler", "ruler_score_group"]
