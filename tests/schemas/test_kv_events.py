"""The chained page hash that workers and the API's prefix index compute alike."""

from __future__ import annotations


def test_page_hashes_chain_page_hash_over_full_pages_only() -> None:
    """The packed-once loop gives what :func:`page_hash` chained page by page gives (the
    hash the API's prefix index and every worker must agree on), for a partial last page,
    an empty prompt and large token ids."""
    import random

    from pdserve.schemas.kv_events import page_hash, page_hashes

    rng = random.Random(3)
    tokens = [rng.randrange(1 << 40) for _ in range(16 * 7 + 5)]
    expected, parent = [], None
    for start in range(0, 16 * 7, 16):
        parent = page_hash(parent, tokens[start : start + 16])
        expected.append(parent)
    assert page_hashes(tokens, 16) == expected
    assert page_hashes(tokens[:15], 16) == [] and page_hashes([], 16) == []
    assert page_hashes(tuple(tokens[:32]), 16) == expected[:2]
    # a chain continued from a page's hash: what hashing the whole prefix at once gives
    assert expected[:3] + page_hashes(tokens[48:], 16, parent=expected[2]) == expected
