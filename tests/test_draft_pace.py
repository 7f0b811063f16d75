"""`DraftPace`: how many drafts a speculative pass takes, from how drafts fared and what passes cost."""

from __future__ import annotations

from swarmnode.client.drafts import DraftPace


def _timed(pace: DraftPace, plain: float, per_draft: float) -> None:
    for _ in range(5):
        pace.timed(0, plain)
        pace.timed(4, plain + 4 * per_draft)


def test_grows_after_whole_passes_and_shrinks_after_rejections():
    pace = DraftPace(10)
    assert pace.allowed() == 10
    pace.passed(10, 3)
    assert pace.allowed() == 4
    pace.passed(4, 4)
    assert pace.allowed() == 6
    pace.passed(6, 6)
    pace.passed(8, 8)
    pace.passed(10, 10)
    assert pace.allowed() == 10


def test_two_fully_rejected_passes_rest_then_probe():
    pace = DraftPace(10)
    pace.passed(10, 0)
    assert pace.allowed() == 1
    pace.passed(1, 0)
    assert [pace.allowed() for _ in range(3)] == [0, 0, 0]  # resting: asking again changes nothing
    pace.passed(0, 0)
    pace.passed(0, 0)
    assert pace.allowed() == 1 and pace.probe  # one pass drafts again
    pace.passed(1, 0)
    pace.passed(1, 0)
    assert pace.rest == 4  # the next rest is twice as long


def test_drafts_that_seldom_pass_are_not_sent_where_each_costs_much():
    """Acceptance about 1 in 5, each draft adding 40% of a pass: no number of drafts pays, so none is sent."""
    pace = DraftPace(10)
    _timed(pace, 0.1, 0.04)
    for _ in range(10):
        pace.passed(1, 0)
        pace.rest = pace.misses = 0  # look at the cost model alone
        pace.passed(2, 1)
        pace.rest = pace.misses = 0
    assert pace.best(10) == 0
    assert pace.allowed() == 0 and pace.rest > 0


def test_drafts_that_often_pass_are_sent_even_where_each_costs_much():
    pace = DraftPace(10)
    _timed(pace, 0.1, 0.04)
    for _ in range(10):
        pace.passed(6, 6)
    assert pace.allowed() == 10 and pace.best(10) == 10


def test_where_drafts_cost_nothing_even_rare_ones_are_sent():
    """A node whose passes cost the same with drafts (a GPU, a link-bound route): a draft that passes 1 time in 4
    still adds tokens for free."""
    pace = DraftPace(10)
    _timed(pace, 0.1, 0.0)
    for _ in range(10):
        pace.passed(3, 0)
        pace.rest = pace.misses = 0
        pace.passed(3, 2)
    assert pace.best(pace.limit) >= 1 and pace.allowed() >= 1
