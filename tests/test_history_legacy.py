"""ART 0.5.23's `History` / `LegacyHistory`, and ART 0.5.18's `History(messages_and_choices=...)` spelling."""

import warnings

import pydantic
import pytest

import artrl as art
import artrl.trajectories.history as trajectories_module
from artrl.errors import TrajectoryError
from artrl.trajectories import History, LegacyHistory

USER = {"role": "user", "content": "hi"}


@pytest.fixture(autouse=True)
def _fresh_notice(monkeypatch):
    monkeypatch.setattr(trajectories_module, "_warned_legacy_history", False)


def test_the_names_are_exported_where_art_has_them_and_at_top_level():
    assert art.History is History and art.LegacyHistory is LegacyHistory
    assert {"History", "LegacyHistory"} <= set(art.__all__)


def test_legacy_history_is_arts_conversation_and_not_a_history():
    h = LegacyHistory(messages_and_choices=[USER], tools=None)
    assert h.messages() == [USER] and h.tools is None
    assert set(LegacyHistory.model_fields) == {"messages_and_choices", "tools"}
    assert not issubclass(LegacyHistory, History) and not isinstance(h, History)


def test_history_is_the_protocol_native_base_with_a_model_and_no_extra_fields():
    h = History(model="agent")
    assert type(h) is History and h.model == "agent"
    assert History(model=None).model is None
    with pytest.raises(pydantic.ValidationError, match="model"):
        History()
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        History(model="agent", tools=None)
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        History(model="agent", messages_and_choices=[USER])
    with pytest.raises(ValueError, match="History cannot be represented as Chat Completions"):
        h.as_chat_completions_history()


def test_the_0518_spelling_builds_a_legacy_history_with_one_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="LegacyHistory"):
        h = History(messages_and_choices=[USER], tools=[])
    assert type(h) is LegacyHistory and h.messages() == [USER] and h.tools == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = History.model_validate({"messages_and_choices": [USER]})  # one warning per process
    assert type(again) is LegacyHistory
    t = art.Trajectory(messages_and_choices=[USER], additional_histories=[h, again])
    assert [type(x) for x in t.additional_histories] == [LegacyHistory, LegacyHistory]
    t.validate_fields()


def test_model_validate_of_a_0518_dict_and_of_a_new_one():
    with pytest.warns(DeprecationWarning):
        assert type(History.model_validate({"messages_and_choices": []})) is LegacyHistory
    assert type(History.model_validate({"model": "m"})) is History


def test_additional_histories_take_legacy_histories_only():
    t = art.Trajectory(additional_histories=[{"messages_and_choices": [USER]}])
    assert type(t.additional_histories[0]) is LegacyHistory
    with pytest.raises(TrajectoryError, match="LegacyHistory"):
        art.Trajectory(additional_histories=[History(model="m")])
