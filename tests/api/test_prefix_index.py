"""The index of cached prefixes and the choice of a worker (plain Python)."""

from __future__ import annotations

from pdserve.api.prefix_index import PrefixIndex, Target, best_worker, coldest_worker
from pdserve.schemas import KVEvents
from pdserve.schemas.kv_events import page_hashes, salt_root

PAGE = 4
PROMPT = list(range(10, 30))  # five pages


def hexes(tokens: list[int]) -> tuple[str, ...]:
    return tuple(h.hex() for h in page_hashes(tokens, PAGE))


def test_a_worker_matches_the_leading_pages_it_announced() -> None:
    index = PrefixIndex()
    index.apply(KVEvents("a", "m", PAGE, stored=hexes(PROMPT[:12])))
    index.apply(KVEvents("b", "m", PAGE, stored=hexes(PROMPT[:4])))
    assert index.matches(PROMPT) == {"a": 12, "b": 4}
    assert index.matches([99, *PROMPT]) == {}, "a different first page is a different prefix"
    assert index.matches(PROMPT[:11]) == {"a": 8, "b": 4}, "only full pages count"


def test_a_salted_prompt_matches_only_pages_announced_under_its_salt() -> None:
    """``cache_salt``: a salted prompt's chain starts from its salt's root, so the index finds
    it only where a worker announced pages hashed under the same salt."""
    index = PrefixIndex()
    salted = tuple(h.hex() for h in page_hashes(PROMPT[:12], PAGE, salt_root("tenant-a")))
    assert set(salted).isdisjoint(hexes(PROMPT[:12]))
    index.apply(KVEvents("a", "m", PAGE, stored=salted))
    index.apply(KVEvents("b", "m", PAGE, stored=hexes(PROMPT[:8])))
    assert index.matches(PROMPT, salt_root("tenant-a")) == {"a": 12}
    assert index.matches(PROMPT, salt_root("tenant-b")) == {}
    assert index.matches(PROMPT) == {"b": 8}
    assert salt_root(None) is None and salt_root("x") != salt_root("y")


def test_evictions_and_departures_are_forgotten() -> None:
    index = PrefixIndex()
    stored = hexes(PROMPT)
    index.apply(KVEvents("a", "m", PAGE, stored=stored))
    index.apply(KVEvents("a", "m", PAGE, evicted=stored[2:3]))
    assert index.matches(PROMPT) == {"a": 8}
    index.apply(KVEvents("b", "m", PAGE, stored=stored))
    index.forget({"a"})
    assert index.matches(PROMPT) == {"b": 20} and index.workers() == {"b"}


def test_each_worker_s_pages_are_counted_and_a_new_prefix_goes_to_the_coldest() -> None:
    index = PrefixIndex()
    index.apply(KVEvents("a", "m", PAGE, stored=hexes(PROMPT)))
    index.apply(KVEvents("a", "m", PAGE, stored=hexes(PROMPT)[:2], evicted=hexes(PROMPT)[4:]))
    index.apply(KVEvents("b", "m", PAGE, stored=hexes(PROMPT)[:2]))
    assert index.pages == {"a": 4, "b": 2}
    assert coldest_worker({"a", "b", "c"}, index.pages) == "c"
    assert coldest_worker({"a", "b"}, index.pages) == "b"
    assert coldest_worker(set(), index.pages) is None


def test_the_index_is_bounded_oldest_first() -> None:
    index = PrefixIndex(max_hashes=3)
    index.apply(KVEvents("a", "m", PAGE, stored=hexes(PROMPT)))
    assert len(index) == 3 and index.pages == {"a": 3}
    assert index.matches(PROMPT) == {}, "the leading pages went first"


def test_the_longest_cached_prefix_among_candidates_wins() -> None:
    matches = {"a": 64, "b": 128, "c": 256}
    assert best_worker(matches, {"a", "b"}, 64) == Target("b", 128)
    assert best_worker(matches, {"a", "b"}, 200) is None
    assert best_worker(matches, {"a", "d"}, 1) == Target("a", 64)
    assert best_worker({"a": 64, "b": 64}, {"b", "a"}, 1) == Target("a", 64), "ties: the first id"
    assert best_worker({"a": 64, "b": 64}, {"b", "a"}, 1, busy={"a": 3, "b": 1}) == Target("b", 64)
    assert best_worker({}, set(), 1) is None
