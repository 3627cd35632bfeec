"""freeze_heap: what a worker process does once its engine is built."""

from __future__ import annotations

import gc

from pdserve.engine.loader import freeze_heap


def test_freeze_heap_moves_the_live_objects_out_of_the_collector_s_walks() -> None:
    """Objects alive when the heap is frozen are no longer walked by a full collection (its
    walk is what stalls the engine's thread); ones made later still are, and still go."""
    kept = [[i] for i in range(10_000)]
    try:
        frozen = freeze_heap()
        assert frozen >= len(kept) and gc.get_freeze_count() == frozen
        tracked = {id(o) for o in gc.get_objects(generation=2)}
        assert not any(id(o) in tracked for o in kept[::997])
        later = [[i] for i in range(100)]
        gc.collect()
        assert id(later[0]) in {id(o) for o in gc.get_objects(generation=2)}
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert id(kept[0]) in {id(o) for o in gc.get_objects(generation=2)}
