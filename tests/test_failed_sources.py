"""FailedSources: the cooldown an engine gives a source whose load just failed."""

from __future__ import annotations

import pytest

from remote_g2.adapters.failed_sources import FailedSources


def test_a_failed_source_cools_down_then_may_be_tried_again():
    f = FailedSources(cooldown_s=30.0)
    assert f.remaining("a", now=100.0) == 0.0
    assert f.note_failure("a", now=100.0) is True
    assert f.remaining("a", now=100.0) == pytest.approx(30.0)
    assert f.remaining("a", now=129.5) == pytest.approx(0.5)
    assert f.remaining("b", now=110.0) == 0.0  # only the source that failed
    assert f.remaining("a", now=130.0) == 0.0


def test_another_failure_restarts_the_cooldown_and_says_it_was_cooling(caplog):
    f = FailedSources(cooldown_s=10.0)
    with caplog.at_level("WARNING", logger="remote_g2.adapters.failed_sources"):
        assert f.note_failure("a", "req-1", now=0.0) is True
    assert caplog.messages == ["a load from a failed (request req-1): not loading from it for 10 s"]
    with caplog.at_level("WARNING", logger="remote_g2.adapters.failed_sources"):
        assert f.note_failure("a", now=5.0) is False  # already cooling: logged once, not again
    assert len(caplog.messages) == 1
    assert f.remaining("a", now=14.0) == pytest.approx(1.0)
    assert f.remaining("a", now=15.0) == 0.0
    assert f.note_failure("a", now=20.0) is True  # expired, so this one is news


def test_zero_cooldown_never_holds_a_source_back_and_negative_is_refused():
    f = FailedSources(cooldown_s=0.0)
    f.note_failure("a", now=1.0)
    assert f.remaining("a", now=1.0) == 0.0
    with pytest.raises(ValueError, match="cooldown_s"):
        FailedSources(cooldown_s=-1)
