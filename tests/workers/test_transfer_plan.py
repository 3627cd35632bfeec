"""Read plans for pulling KV pages (``plan_reads``) and page runs of a block table (``page_runs``)."""

from __future__ import annotations

import itertools
import random

import pytest

from pdserve.engine.kv_pool import page_runs
from pdserve.workers.transfer.base import TransferError, plan_reads

PB = 1024  # bytes per page
REMOTE = 1_000_000  # remote pool base address
LOCAL = 5_000_000  # local pool base address


def _segments(pages: list[int], base: int = REMOTE) -> list[tuple[int, int]]:
    """What the prefill side publishes: one (address, nbytes) per run of its pages."""
    return [(base + start * PB, n * PB) for start, n in page_runs(pages)]


def _copy_map(reads: list[tuple[int, int, int]]) -> dict[int, int]:
    """local page address -> remote page address, per page, from a read plan."""
    out: dict[int, int] = {}
    for local, remote, nbytes in reads:
        assert nbytes > 0 and nbytes % PB == 0
        for i in range(nbytes // PB):
            assert local + i * PB not in out, "a local page is written twice"
            out[local + i * PB] = remote + i * PB
    return out


# ---- page_runs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pages", "runs"),
    [
        ([], []),
        ([7], [(7, 1)]),
        ([0, 1, 2, 3], [(0, 4)]),
        ([3, 4, 5, 9, 10, 2], [(3, 3), (9, 2), (2, 1)]),
        ([5, 4, 3], [(5, 1), (4, 1), (3, 1)]),  # descending ids do not merge
        ([1, 1], [(1, 1), (1, 1)]),
        ([0, 2, 4], [(0, 1), (2, 1), (4, 1)]),
        ([10, 11, 0, 1, 12], [(10, 2), (0, 2), (12, 1)]),  # order is preserved
    ],
)
def test_page_runs(pages: list[int], runs: list[tuple[int, int]]) -> None:
    assert page_runs(pages) == runs


def test_page_runs_random_round_trip() -> None:
    rng = random.Random(0)
    for _ in range(200):
        pages = rng.sample(range(64), rng.randrange(0, 30))
        if rng.random() < 0.5:
            pages.sort()
        runs = page_runs(pages)
        assert [start + i for start, n in runs for i in range(n)] == pages
        # maximal: consecutive runs never continue each other
        assert all(a[0] + a[1] != b[0] for a, b in itertools.pairwise(runs))
        assert all(n >= 1 for _, n in runs)


# ---- plan_reads -------------------------------------------------------------------------------


def test_contiguous_on_both_sides_is_one_read() -> None:
    reads = plan_reads(_segments([4, 5, 6, 7]), PB, [10, 11, 12, 13], LOCAL)
    assert reads == [(LOCAL + 10 * PB, REMOTE + 4 * PB, 4 * PB)]


def test_several_remote_segments_that_touch_merge() -> None:
    # two segments that happen to be adjacent in memory still make one read
    segments = [(REMOTE, 2 * PB), (REMOTE + 2 * PB, PB)]
    reads = plan_reads(segments, PB, [0, 1, 2], LOCAL)
    assert reads == [(LOCAL, REMOTE, 3 * PB)]


def test_break_on_remote_side_splits() -> None:
    reads = plan_reads(_segments([0, 1, 5, 6]), PB, [20, 21, 22, 23], LOCAL)
    assert reads == [
        (LOCAL + 20 * PB, REMOTE + 0 * PB, 2 * PB),
        (LOCAL + 22 * PB, REMOTE + 5 * PB, 2 * PB),
    ]


def test_break_on_local_side_splits() -> None:
    reads = plan_reads(_segments([0, 1, 2, 3]), PB, [8, 9, 3, 4], LOCAL)
    assert reads == [
        (LOCAL + 8 * PB, REMOTE + 0 * PB, 2 * PB),
        (LOCAL + 3 * PB, REMOTE + 2 * PB, 2 * PB),
    ]


def test_breaks_on_both_sides() -> None:
    remote = [0, 1, 2, 7, 8, 9]
    local = [30, 31, 40, 41, 42, 50]
    reads = plan_reads(_segments(remote), PB, local, LOCAL)
    # breaks: local after 1, remote after 2, local after 4
    assert reads == [
        (LOCAL + 30 * PB, REMOTE + 0 * PB, 2 * PB),
        (LOCAL + 40 * PB, REMOTE + 2 * PB, PB),
        (LOCAL + 41 * PB, REMOTE + 7 * PB, 2 * PB),
        (LOCAL + 50 * PB, REMOTE + 9 * PB, PB),
    ]


def test_reversed_local_pages_do_not_merge() -> None:
    reads = plan_reads(_segments([0, 1, 2]), PB, [5, 4, 3], LOCAL)
    assert reads == [
        (LOCAL + 5 * PB, REMOTE, PB),
        (LOCAL + 4 * PB, REMOTE + PB, PB),
        (LOCAL + 3 * PB, REMOTE + 2 * PB, PB),
    ]


def test_skip_pages() -> None:
    remote = _segments([0, 1, 2, 3, 4])
    local = [10, 11, 12, 13, 14]
    assert plan_reads(remote, PB, local, LOCAL, skip_pages=2) == [(LOCAL + 12 * PB, REMOTE + 2 * PB, 3 * PB)]
    assert plan_reads(remote, PB, local, LOCAL, skip_pages=4) == [(LOCAL + 14 * PB, REMOTE + 4 * PB, PB)]
    assert plan_reads(remote, PB, local, LOCAL, skip_pages=5) == []
    assert plan_reads(remote, PB, local, LOCAL, skip_pages=0) == plan_reads(remote, PB, local, LOCAL)


def test_skip_pages_with_shared_prefix_pages_elsewhere() -> None:
    # the first two local pages are a prefix hit (anywhere in the pool); only the rest is pulled
    reads = plan_reads(_segments([0, 1, 2, 3]), PB, [40, 7, 20, 21], LOCAL, skip_pages=2)
    assert reads == [(LOCAL + 20 * PB, REMOTE + 2 * PB, 2 * PB)]


def test_empty_plan() -> None:
    assert plan_reads([], PB, [], LOCAL) == []


@pytest.mark.parametrize(
    ("segments", "local"),
    [
        ([(REMOTE, 3 * PB)], [1, 2]),  # remote has more pages
        ([(REMOTE, PB)], [1, 2]),  # local reserved more
        ([], [1]),
        ([(REMOTE, 2 * PB), (REMOTE + 8 * PB, 2 * PB)], [1, 2, 3]),
    ],
)
def test_mismatched_page_counts(segments: list[tuple[int, int]], local: list[int]) -> None:
    with pytest.raises(TransferError, match="pages"):
        plan_reads(segments, PB, local, LOCAL)


@pytest.mark.parametrize("nbytes", [PB + 1, PB // 2, 3 * PB - 8])
def test_segments_that_are_not_whole_pages(nbytes: int) -> None:
    with pytest.raises(TransferError, match="not whole pages"):
        plan_reads([(REMOTE, PB), (REMOTE + 4 * PB, nbytes)], PB, [0, 1, 2, 3], LOCAL)


def test_transfer_error_is_a_runtime_error() -> None:
    assert issubclass(TransferError, RuntimeError)


def test_random_plans_copy_every_page_once() -> None:
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randrange(1, 25)
        remote = rng.sample(range(64), n)
        if rng.random() < 0.5:
            remote.sort()
        local = rng.sample(range(64), n)
        if rng.random() < 0.5:
            local.sort()
        skip = rng.randrange(0, n + 1)
        reads = plan_reads(_segments(remote), PB, local, LOCAL, skip)
        expected = {LOCAL + local[i] * PB: REMOTE + remote[i] * PB for i in range(skip, n)}
        assert _copy_map(reads) == expected
        # maximal merging: as many reads as runs where both sides continue
        breaks = sum(1 for i in range(skip + 1, n) if local[i] != local[i - 1] + 1 or remote[i] != remote[i - 1] + 1)
        assert len(reads) == (breaks + 1 if skip < n else 0)


def test_a_wildcard_host_is_advertised_as_a_real_address() -> None:
    import ipaddress

    from pdserve.workers.transfer import advertised_host

    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("node-7") == "node-7"
    for wildcard in ("0.0.0.0", "::", ""):
        address = ipaddress.ip_address(advertised_host(wildcard))
        assert not address.is_unspecified
