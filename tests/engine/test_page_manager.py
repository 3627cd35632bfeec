"""Page allocator and prefix index: refcounts, chained hashes, LRU eviction, invariants."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.page_manager import OutOfPages, PageManager
from pdserve.engine.sequence import Sequence as Seq
from pdserve.schemas import SamplingParams
from pdserve.schemas.kv_events import page_hash

PS = 4


def _bm(num_pages: int = 8, page_size: int = PS, cache: bool = True) -> PageManager:
    bm = PageManager(num_pages, page_size, enable_prefix_cache=cache)
    bm.check_invariants()
    return bm


def _cache_prompt(bm: PageManager, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """Allocate pages for ``tokens``, register the full ones (as the scheduler does)."""
    pages = bm.allocate(bm.pages_for(len(tokens)))
    hashes = bm.match_prefix(tokens)
    for page, h in zip(pages, hashes, strict=False):
        bm.register(page, h)
    return pages, hashes


# ---- allocation and refcounts ---------------------------------------------------------


def test_fresh_pool() -> None:
    bm = _bm(8)
    assert bm.num_free_pages == 8
    assert bm.num_used_pages == 0
    assert bm.num_cached_pages == 0
    assert all(bm.ref_count(p) == 0 for p in range(8))


def test_allocate_and_free_refcounts() -> None:
    bm = _bm(8)
    a = bm.allocate(3)
    assert a == [0, 1, 2]  # low ids first
    assert len(set(a)) == 3
    assert all(bm.ref_count(p) == 1 for p in a)
    assert bm.num_free_pages == 5 and bm.num_used_pages == 3
    b = bm.allocate(5)
    assert set(a).isdisjoint(b)
    assert bm.num_free_pages == 0
    bm.check_invariants()
    bm.free(a)
    assert all(bm.ref_count(p) == 0 for p in a)
    assert bm.num_free_pages == 3
    bm.free(b)
    assert bm.num_free_pages == 8
    bm.check_invariants()


def test_allocate_zero_pages() -> None:
    bm = _bm(2)
    assert bm.allocate(0) == []
    assert bm.num_free_pages == 2


def test_out_of_pages() -> None:
    bm = _bm(4)
    assert bm.can_allocate(4) and not bm.can_allocate(5)
    with pytest.raises(OutOfPages, match="need 5 pages, 4 free"):
        bm.allocate(5)
    # a failed allocation takes nothing
    assert bm.num_free_pages == 4
    bm.check_invariants()
    bm.allocate(3)
    with pytest.raises(OutOfPages):
        bm.allocate(2)
    assert bm.num_free_pages == 1


def test_double_free_asserts() -> None:
    bm = _bm(4)
    pages = bm.allocate(2)
    bm.free(pages)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(pages[:1])
    with pytest.raises(AssertionError, match="double free"):
        bm.free([3])  # never allocated


def test_share_then_free_needs_every_reference() -> None:
    bm = _bm(4)
    pages = bm.allocate(2)
    bm.share(pages)
    bm.share(pages[:1])
    assert [bm.ref_count(p) for p in pages] == [3, 2]
    bm.free(pages)
    assert bm.num_free_pages == 2
    bm.free(pages)
    assert [bm.ref_count(p) for p in pages] == [1, 0]
    assert bm.num_free_pages == 3
    bm.free(pages[:1])
    assert bm.num_free_pages == 4
    bm.check_invariants()


def test_pages_for() -> None:
    bm = _bm(8, page_size=16)
    assert [bm.pages_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


# ---- hashing ---------------------------------------------------------------------------


def test_page_hash_is_chained() -> None:
    page = [5, 6, 7, 8]
    h_root = page_hash(None, page)
    assert h_root == page_hash(None, list(page)) == page_hash(None, tuple(page))
    parent_a = page_hash(None, [1, 2, 3, 4])
    parent_b = page_hash(None, [1, 2, 3, 9])
    # the same page content under a different prefix hashes differently
    assert page_hash(parent_a, page) != page_hash(parent_b, page)
    assert page_hash(parent_a, page) != h_root
    assert page_hash(parent_a, page) == page_hash(parent_a, page)
    # token order and values matter
    assert page_hash(None, [1, 2, 3, 4]) != page_hash(None, [2, 1, 3, 4])
    assert page_hash(None, [0, 0, 0, 0]) != page_hash(None, [0, 0, 0, 1])
    assert len(h_root) == 16


def test_match_prefix_covers_full_pages_only() -> None:
    bm = _bm()
    tokens = list(range(11))  # two full pages, one partial
    hashes = bm.match_prefix(tokens)
    assert len(hashes) == 2
    assert hashes[0] == page_hash(None, tokens[0:4])
    assert hashes[1] == page_hash(hashes[0], tokens[4:8])
    assert bm.match_prefix(tokens[:3]) == []
    assert len(bm.match_prefix(tokens[:8])) == 2
    # equal second pages under different first pages differ
    other = [99, *tokens[1:]]
    assert bm.match_prefix(other)[1] != hashes[1]
    assert bm.match_prefix(tokens + [1])[:2] == hashes


# ---- lookup ----------------------------------------------------------------------------


def test_lookup_longest_cached_prefix() -> None:
    bm = _bm(16)
    tokens = list(range(100, 113))  # 3 full pages + 1 token
    pages, hashes = _cache_prompt(bm, tokens)
    assert bm.num_cached_pages == 3
    assert bm.lookup(hashes) == pages[:3]
    # a longer prompt with the same start finds the same 3 pages
    longer = tokens[:12] + [7, 7, 7, 7, 8]
    assert bm.lookup(bm.match_prefix(longer)) == pages[:3]
    # diverging in the 2nd page: only the first is found
    diverged = tokens[:5] + [0] + tokens[6:]
    assert bm.lookup(bm.match_prefix(diverged)) == pages[:1]
    # diverging in the 1st page: nothing, even though pages 2 and 3 hold the same tokens
    assert bm.lookup(bm.match_prefix([0, *tokens[1:]])) == []
    # the lookup stops at the first miss
    assert bm.lookup([hashes[0], b"x" * 16, hashes[2]]) == pages[:1]
    assert bm.lookup([]) == []
    bm.check_invariants()


def test_register_is_idempotent_and_first_copy_wins() -> None:
    bm = _bm(8)
    tokens = [1, 2, 3, 4]
    (h,) = bm.match_prefix(tokens)
    a = bm.allocate(1)[0]
    b = bm.allocate(1)[0]
    bm.register(a, h)
    bm.register(a, h)
    bm.register(b, h)  # an equal page is already indexed; b stays private
    assert bm.num_cached_pages == 1
    assert bm.lookup([h]) == [a]
    bm.free([b])
    assert bm.num_free_pages == 7  # b went straight back to the free list
    bm.free([a])
    assert bm.num_free_pages == 8
    assert bm.lookup([h]) == [a]  # still findable while evictable
    bm.check_invariants()


def test_share_and_free_keep_cached_pages_evictable() -> None:
    bm = _bm(8)
    tokens = list(range(9))  # 2 full pages + 1
    pages, hashes = _cache_prompt(bm, tokens)
    bm.free(pages)
    # full pages stay in the index, the partial one is plainly free
    assert bm.num_free_pages == 8
    assert bm.num_cached_pages == 2
    assert bm.lookup(hashes) == pages[:2]
    bm.check_invariants()
    # a prefix hit takes them out of the evictable set
    hit = bm.lookup(hashes)
    bm.share(hit)
    assert [bm.ref_count(p) for p in hit] == [1, 1]
    assert bm.num_free_pages == 6
    bm.check_invariants()
    # allocating everything else never takes the shared pages
    rest = bm.allocate(6)
    assert set(rest).isdisjoint(hit)
    assert bm.lookup(hashes) == hit
    assert not bm.can_allocate(1)
    bm.free(rest)
    bm.free(hit)
    assert bm.num_free_pages == 8
    assert bm.lookup(hashes) == hit
    bm.check_invariants()


def test_free_list_is_used_before_evicting_cached_pages() -> None:
    bm = _bm(6)
    pages, hashes = _cache_prompt(bm, list(range(8)))  # 2 cached pages
    bm.free(pages)
    fresh = bm.allocate(4)
    assert set(fresh).isdisjoint(pages)
    assert bm.lookup(hashes) == pages  # nothing evicted yet
    bm.check_invariants()


def test_lru_eviction_order() -> None:
    bm = _bm(6)
    a_pages, a_hashes = _cache_prompt(bm, [1] * 8)  # 2 cached pages
    b_pages, b_hashes = _cache_prompt(bm, [2] * 8)
    c_pages, c_hashes = _cache_prompt(bm, [3] * 8)
    assert bm.num_free_pages == 0
    # release order: B, then A, then C -> LRU order B, A, C
    bm.free(b_pages)
    bm.free(a_pages)
    bm.free(c_pages)
    assert bm.num_cached_pages == 6 and bm.num_free_pages == 6
    # touch A again (a prefix hit) and let it go: A becomes the most recently used
    bm.share(a_pages)
    bm.free(a_pages)
    # the free list is empty: allocation evicts the least recently released pages first,
    # and within one sequence the tail page goes before the head page
    first = bm.allocate(1)
    assert first == [b_pages[1]]
    assert bm.lookup(b_hashes) == [b_pages[0]]
    second = bm.allocate(1)
    assert second == [b_pages[0]]
    assert bm.lookup(b_hashes) == []  # evicted pages vanish from the index
    third = bm.allocate(2)
    assert third == [c_pages[1], c_pages[0]]
    assert bm.lookup(c_hashes) == []
    assert bm.lookup(a_hashes) == a_pages  # A survived: it was used most recently
    assert bm.num_cached_pages == 2
    # evicted pages come back as fresh, uncached pages with one reference
    assert all(bm.ref_count(p) == 1 for p in first + second + third)
    bm.check_invariants()
    # re-registering an evicted page under a new hash works
    (h_new,) = bm.match_prefix([9, 9, 9, 9])
    bm.register(first[0], h_new)
    assert bm.lookup([h_new]) == first
    bm.check_invariants()


def test_evicted_hash_can_be_cached_again_on_another_page() -> None:
    bm = _bm(2, page_size=2)
    pages, hashes = _cache_prompt(bm, [1, 2, 3, 4])
    bm.free(pages)
    bm.allocate(2)  # evicts both
    assert bm.lookup(hashes) == []
    assert bm.num_cached_pages == 0
    bm.check_invariants()


def test_reset_prefix_cache() -> None:
    bm = _bm(8)
    a_pages, a_hashes = _cache_prompt(bm, [1] * 8)
    b_pages, b_hashes = _cache_prompt(bm, [2] * 8)
    bm.free(a_pages)  # A evictable, B still referenced
    bm.reset_prefix_cache()
    assert bm.lookup(a_hashes) == []
    assert bm.lookup(b_hashes) == b_pages  # referenced cached pages stay indexed
    assert bm.num_free_pages == 6
    bm.check_invariants()
    bm.free(b_pages)
    assert bm.num_free_pages == 8
    bm.check_invariants()


def test_reset_prefix_cache_of_pages_in_use_too() -> None:
    """What /flush_cache does: nothing cached is found afterwards, pages in use stay theirs."""
    bm = _bm(8)
    a_pages, a_hashes = _cache_prompt(bm, [1] * 8)
    b_pages, b_hashes = _cache_prompt(bm, [2] * 8)
    bm.free(a_pages)
    assert bm.reset_prefix_cache(in_use=True) == 2
    assert bm.lookup(a_hashes) == [] and bm.lookup(b_hashes) == []
    assert [bm.ref_count(p) for p in b_pages] == [1, 1]
    bm.free(b_pages)
    assert bm.num_free_pages == 8 and bm.num_cached_pages == 0
    bm.check_invariants()


def test_disabled_prefix_cache() -> None:
    bm = _bm(4, cache=False)
    pages = bm.allocate(2)
    hashes = bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert len(hashes) == 2  # hashing still works
    for page, h in zip(pages, hashes, strict=True):
        bm.register(page, h)
    assert bm.num_cached_pages == 0
    assert bm.lookup(hashes) == []
    bm.free(pages)
    assert bm.num_free_pages == 4
    assert bm.lookup(hashes) == []
    bm.check_invariants()
    # freed pages go straight back to the free list
    assert sorted(bm.allocate(4)) == [0, 1, 2, 3]


def test_check_invariants_detects_corruption() -> None:
    bm = _bm(4)
    pages = bm.allocate(1)
    bm._free.append(pages[0])  # referenced and free at once
    with pytest.raises(AssertionError):
        bm.check_invariants()


# ---- random property test -------------------------------------------------------------


def _check_index(bm: PageManager) -> None:
    """Stronger than ``check_invariants``: the two index maps mirror each other."""
    bm.check_invariants()
    assert len(bm._hash_of) == len(bm._page_of)
    for page, h in bm._hash_of.items():
        assert bm._page_of[h] == page
    assert bm.num_free_pages + sum(1 for p in range(bm.num_pages) if bm.ref_count(p) > 0) == bm.num_pages


def _take(expected_refs: list[int], pages: list[int], delta: int) -> None:
    for p in pages:
        expected_refs[p] += delta


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants(seed: int, cache: bool) -> None:
    rng = random.Random(seed)
    num_pages = 24
    bm = PageManager(num_pages, PS, enable_prefix_cache=cache)
    owners: list[list[int]] = []  # each entry holds one reference on each of its pages
    expected_refs = [0] * num_pages
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(1, 5 * PS))] for _ in range(12)]
    for _ in range(3000):
        op = rng.random()
        if op < 0.2:  # plain allocation
            n = rng.randrange(0, 6)
            if bm.can_allocate(n):
                pages = bm.allocate(n)
                assert len(set(pages)) == n
                assert all(expected_refs[p] == 0 for p in pages)
                owners.append(pages)
                _take(expected_refs, pages, 1)
            else:
                with pytest.raises(OutOfPages):
                    bm.allocate(n)
        elif op < 0.55 and owners:  # release one owner's references
            pages = owners.pop(rng.randrange(len(owners)))
            bm.free(pages)
            _take(expected_refs, pages, -1)
        elif op < 0.8:  # a "request": reuse the cached prefix, allocate the rest, register full pages
            tokens = prompts[rng.randrange(len(prompts))]
            hashes = bm.match_prefix(tokens)
            cached = bm.lookup(hashes)
            if cache:
                assert all(bm._hash_of[p] == h for p, h in zip(cached, hashes, strict=False))
            else:
                assert cached == []
            need = bm.pages_for(len(tokens)) - len(cached)
            bm.share(cached)
            if bm.can_allocate(need):
                pages = cached + bm.allocate(need)
                for page, h in zip(pages, hashes, strict=False):
                    bm.register(page, h)
                owners.append(pages)
                _take(expected_refs, pages, 1)
            else:
                bm.free(cached)
        elif op < 0.9 and owners:  # another holder of the same pages
            pages = list(owners[rng.randrange(len(owners))])
            bm.share(pages)
            owners.append(pages)
            _take(expected_refs, pages, 1)
        elif op < 0.92:
            bm.reset_prefix_cache()
        _check_index(bm)
        assert [bm.ref_count(p) for p in range(num_pages)] == expected_refs
    while owners:
        bm.free(owners.pop())
    assert bm.num_free_pages == num_pages
    assert all(bm.ref_count(p) == 0 for p in range(num_pages))
    _check_index(bm)
    if not cache:
        assert bm.num_cached_pages == 0


def _seq(rid: str, prompt: list[int]) -> Seq:
    return Seq(rid, prompt, SamplingParams(max_new_tokens=4))


def test_reserve_prompt_counts_cached_pages_it_takes_off_the_free_list() -> None:
    """Cached evictable pages are free until shared: a prompt that reuses them and needs
    more pages than the truly free ones is refused (nothing held), never OutOfPages."""
    pm = PageManager(6, 4)
    other = _seq("other", list(range(100, 108)))
    assert pm.grow(other, 8)  # two pages in use by someone else
    first = _seq("first", list(range(8)))
    assert pm.grow(first, 8)
    first.num_computed = 8
    pm.register_full_pages(first)
    pm.release(first)  # its two pages stay cached and evictable
    assert pm.num_free_pages == 4 and pm.num_cached_pages == 2
    second = _seq("second", list(range(8)) + list(range(50, 61)))  # 2 cached pages + 3 new
    assert not pm.reserve_prompt(second)
    assert second.page_table == [] and second.num_cached == 0
    assert pm.num_free_pages == 4
    pm.check_invariants()
    third = _seq("third", list(range(8)) + [7, 7, 7])  # 2 cached pages + 1 new
    assert pm.reserve_prompt(third)
    assert third.num_cached == 8 and len(third.page_table) == 3
    pm.check_invariants()


def test_a_cold_prompt_is_hashed_past_its_first_pages_only_once_computed() -> None:
    """Attaching a cold prompt hashes one block of pages (the index misses at the first);
    ``hash_pages`` (the engine calls it while the device computes the prompt) and
    ``register_full_pages`` give every full page the hash ``match_prefix`` gives, and a warm
    prompt with a prefix many blocks long finds all of it."""
    pm = PageManager(256, 4)
    rng = random.Random(5)
    tokens = [rng.randrange(1000) for _ in range(4 * 150 + 2)]
    cold = _seq("cold", tokens)
    pm.attach_prefix(cold, len(tokens) - 1)
    assert cold.num_cached == 0 and len(cold.page_hashes) == 16  # one block, not 150 pages
    assert pm.grow(cold, len(tokens))
    pm.hash_pages(cold, len(tokens))
    assert cold.page_hashes == pm.match_prefix(tokens)
    cold.num_computed = len(tokens)
    pm.register_full_pages(cold)
    pages = list(cold.page_table)
    pm.release(cold)
    assert pm.num_cached_pages == 150
    warm = _seq("warm", [*tokens[: 4 * 120], 1, 2, 3, 4, 5])  # 120 cached pages: blocks 16, 32, 64, then 8 of 128
    pm.attach_prefix(warm, warm.num_tokens - 1)
    assert warm.num_cached == 4 * 120 and warm.page_table == pages[:120]
    assert warm.page_hashes == pm.match_prefix(warm.tokens)[: len(warm.page_hashes)]
    pm.check_invariants()


def test_pages_freed_while_a_step_is_queued_wait_for_it() -> None:
    bm = _bm(8)
    a, b = bm.allocate(2), bm.allocate(2)
    bm.park_tag = 5  # step 5 is queued on the device and may still write a's and b's pages
    bm.free(a)
    assert bm.num_parked_pages == 2 and bm.num_free_pages == 4
    bm.check_invariants()
    bm.park_tag = 6
    bm.free(b)
    with pytest.raises(OutOfPages):
        bm.allocate(5)  # parked pages are not handed out
    assert bm.unpark(5) == 2  # step 5 is done: a's pages, not b's
    assert bm.num_parked_pages == 2 and bm.num_free_pages == 6
    assert set(bm.allocate(6)) >= set(a)
    assert bm.unpark() == 2  # all
    bm.check_invariants()


def test_a_cached_page_is_never_parked() -> None:
    bm = _bm(8)
    pages, _ = _cache_prompt(bm, list(range(10)))  # two full pages cached, one partial
    bm.park_tag = 1
    bm.free(pages)
    assert bm.num_parked_pages == 1  # only the partial page: full cached pages are never written again
    assert bm.num_free_pages == 7
    bm.unpark(1)
    bm.check_invariants()
