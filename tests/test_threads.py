"""TVM's CPU pool: sized to torch's threads on artifact load unless the user chose a size."""

import os
import subprocess
import sys
import threading

import pytest
import torch

from dsv41.runtime.backends.threads import default_tvm_pool, size_tvm_pool, tvm_num_threads


def test_pool_follows_torch_unless_chosen(monkeypatch):
    n = torch.get_num_threads()
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    try:
        assert default_tvm_pool() == n == tvm_num_threads()
        assert default_tvm_pool(1) == 1 == tvm_num_threads()  # the engine's `threads` option
        monkeypatch.setenv("TVM_NUM_THREADS", "1")
        assert default_tvm_pool() == 1  # an explicit TVM_NUM_THREADS is kept
        with pytest.raises(ValueError, match="at least 1"):
            size_tvm_pool(0)
    finally:
        size_tvm_pool(n)


def test_engine_option_sizes_the_pool(small_artifact, small_model):
    from dsv41.runtime.backends.artifact import Artifact
    from dsv41.runtime.backends.compiled import CompiledPhases

    n = torch.get_num_threads()
    try:
        CompiledPhases(Artifact.load(small_artifact, args=small_model.args), small_model,
                       threads=1)
        assert tvm_num_threads() == 1
    finally:
        size_tvm_pool(n)


def test_spin_count_defaults_to_zero_and_an_explicit_one_is_kept(monkeypatch):
    from dsv41.runtime.backends.threads import (
        DEFAULT_SPIN_COUNT,
        SPIN_ENV,
        configure_pool,
        pool_config,
    )

    monkeypatch.delenv(SPIN_ENV, raising=False)
    configure_pool()
    assert os.environ[SPIN_ENV] == str(DEFAULT_SPIN_COUNT) == "0"
    monkeypatch.setenv(SPIN_ENV, "5000")
    configure_pool()
    assert os.environ[SPIN_ENV] == "5000"
    assert pool_config().spin_count == 5000
    monkeypatch.setenv(SPIN_ENV, "lots")
    with pytest.raises(ValueError, match="TVM_THREAD_POOL_SPIN_COUNT must be a whole number of "
                                         "spins, got 'lots'."):
        pool_config()


def test_pool_is_configured_before_tvm_starts_it():
    """In a fresh process, the first question to TVM's pool (which starts it, and TVM reads the
    spin count once, there) comes after the spin count is set."""
    code = ("import os\n"
            "from dsv41.runtime.backends.threads import pool_config, size_tvm_pool\n"
            "assert 'TVM_THREAD_POOL_SPIN_COUNT' not in os.environ\n"
            "size_tvm_pool(1)\n"
            "print(os.environ['TVM_THREAD_POOL_SPIN_COUNT'], pool_config().to_dict())\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TVM_THREAD_POOL_SPIN_COUNT", "TVM_NUM_THREADS", "TVM_BIND_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("0 {'threads': 1, 'spin_count': 0, 'bind_threads': True, "
                                  "'launcher': 'tvm', 'launcher_spin_us': 0}")


def nice_of_thread(run) -> tuple[int, int]:
    """(nice of a new thread after `run` ran on it, nice of this thread after)."""
    got = []

    def body():
        run()
        got.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return got[0], os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_helper_threads_run_below_the_compute_threads(tmp_path):
    from dsv41.runtime.backends.threads import HELPER_NICE, lower_helper_priority
    from dsv41.runtime.tiers.block_writer import BlockWriter
    from dsv41.runtime.tiers.ssd_store import KVStore, model_fingerprint

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert nice_of_thread(lower_helper_priority) == (max(HELPER_NICE, mine), mine)
    seen = []
    store = KVStore(tmp_path / "store", capacity_bytes=1 << 20,
                    fingerprint=model_fingerprint("c", "w", 1))
    writer = BlockWriter(store, on_start=lambda: seen.append(threading.current_thread().name))
    writer.close()
    assert seen == ["dsv41-block-writer"]


def test_engram_prefetch_thread_is_a_helper(small_artifact, small_model):
    from dsv41.graph.cache import new_cache
    from dsv41.runtime.backends.artifact import Artifact
    from dsv41.runtime.backends.compiled import CompiledPhases
    from dsv41.runtime.backends.threads import HELPER_NICE

    art = Artifact.load(small_artifact, args=small_model.args)
    ph = CompiledPhases(art, small_model)
    cache = new_cache(small_model.plan, 1, 64, engram_pad=small_model.engram.pad_id)
    ph.ced_prefill(small_model, cache, torch.tensor([[5, 6, 7, 8]]))
    helpers = [t for t in threading.enumerate() if t.name.startswith("dsv41-engram")]
    assert helpers and art.engram_timing().calls > 0
    assert {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in helpers} == {
        max(HELPER_NICE, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))}
