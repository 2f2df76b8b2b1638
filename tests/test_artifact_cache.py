"""The test artifact cache (conftest.py): a build that a test process holds is never evicted by
another process's compile, however old; the others past ARTIFACT_CACHE_KEEP go, oldest first."""

from __future__ import annotations

import os

from conftest import ARTIFACT_CACHE_KEEP, evict_unused, in_use


def test_eviction_passes_over_a_build_in_use(tmp_path):
    cache, locks = tmp_path / "artifacts", tmp_path / "locks"
    cache.mkdir()
    locks.mkdir()
    keys = [f"key{i}" for i in range(ARTIFACT_CACHE_KEEP + 3)]
    for age, key in enumerate(keys):  # key0 the least recently used
        (cache / key).mkdir()
        (cache / key / "done").write_text("cpu")
        os.utime(cache / key / "done", (1000 + age, 1000 + age))
    in_use(locks, "key0")  # this process runs tests on the oldest build
    evict_unused(cache, locks)
    left = sorted(d.name for d in cache.iterdir())
    assert left == ["key0", *keys[3:]]  # key1 and key2 evicted, key0 held, the newest kept
