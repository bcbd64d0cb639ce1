"""Grouping of a bucket's parameters for pipelined collectives (the hook's ``pipeline_bytes``)."""

from lightning_gradcomp.exchange.groups import pipeline_chunks


def test_one_group_without_a_limit() -> None:
    assert pipeline_chunks([4, 8, 16], None) == [[0, 1, 2]]
    assert pipeline_chunks([], None) == []


def test_groups_close_once_they_reach_the_limit_and_never_split_a_parameter() -> None:
    assert pipeline_chunks([4, 4, 4, 4, 4], 8) == [[0, 1], [2, 3], [4]]
    assert pipeline_chunks([100, 1, 1, 100], 8) == [[0], [1, 2, 3]]
    assert pipeline_chunks([100, 100], 1) == [[0], [1]]
    # every index exactly once, in order
    chunks = pipeline_chunks([3, 9, 1, 7, 2, 8], 10)
    assert [i for c in chunks for i in c] == list(range(6))
