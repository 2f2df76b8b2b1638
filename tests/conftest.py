"""Shared fixtures: conformance cases and models are loaded once per session."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

# the repo's sibling `shared/`; DSV41_SHARED points elsewhere (a git worktree has no sibling)
SHARED = Path(os.environ.get("DSV41_SHARED") or Path(__file__).resolve().parents[2] / "shared")
CONFORMANCE = SHARED / "conformance"

# The released goldens were computed with 2 threads; GEMM summation order follows the count.
torch.set_num_threads(2)

MAX_WORKERS = 4  # `-n auto`: test processes, one per core up to this (each holds its models)
PORT_BASE, PORT_BAND = 20000, 500  # `worker_port`: worker i's band (below 32768, the kernel's)
# The test files that take longest (minutes of compiles), handed out first so that no worker is
# left alone with one of them at the end (a file runs in one worker: `--dist loadfile`)
LONGEST_FILES = ("test_kernel_indexer.py", "test_cuda_build.py", "test_capture.py",
                 "test_epd_faults.py", "test_graph.py", "test_engine.py", "test_kernel_moe.py",
                 "test_kernel_gemm.py", "test_kernel_attention.py")
# libgomp's threads (torch's) spin between parallel regions by default: with a worker per core,
# one worker's spinning takes the core from the other. Passive waits change no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(config, items) -> None:
    """LONGEST_FILES first, in that order; every other file after, in collection order."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (the default run): PYTEST_XDIST_AUTO_NUM_WORKERS when set, else one worker per
    core this process may use, at most MAX_WORKERS (CI's 2 cores: 2)."""
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if env:
        return int(env)
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def case_dir(name: str) -> Path:
    path = CONFORMANCE / name
    if not path.exists():
        pytest.skip(f"conformance pack {path} is not present")
    return path


@pytest.fixture(scope="session")
def small_case():
    from dsv41.graph.conformance import load_case

    return load_case(case_dir("shared-small"))


@pytest.fixture(scope="session")
def v41_case():
    from dsv41.graph.conformance import load_case

    return load_case(case_dir("shared-v41-small"))


@pytest.fixture(scope="session")
def vcase():
    """The shared-vision-small conformance case (made with the released vision code)."""
    from dsv41.graph.conformance import load_case

    return load_case(case_dir("shared-vision-small"))


@pytest.fixture(scope="session")
def vmodel(vcase):
    from dsv41.graph.model import Model

    return Model.from_checkpoint(vcase.checkpoint)


@pytest.fixture(scope="session")
def small_model(small_case):
    from dsv41.graph.model import Model

    return Model.from_checkpoint(small_case.checkpoint)


@pytest.fixture(scope="session")
def v41_model(v41_case):
    from dsv41.graph.model import Model

    return Model.from_checkpoint(v41_case.checkpoint)


# the entries compiled once for shared-small (compile, engine and run tests), kept between runs
ARTIFACT_ENTRIES = ("prefill_all", "decode", "encoder", "decoder", "encoder_replay")
PACKAGE = Path(__file__).resolve().parents[1]
ARTIFACT_CACHE_KEEP = 4  # cached builds kept: the newest by use, and any a test process holds


# what a compile reads: the model and kernels, the compile pipeline, the manifest format
COMPILE_SOURCES = ("graph", "schedules", "compiler/build.py", "compiler/capture.py",
                   "compiler/lower.py", "compiler/kernels.py", "compiler/kernel_keys.py",
                   "compiler/relax_ops.py", "compiler/tuning_db.py", "compiler/launcher.py",
                   "runtime/backends/artifact.py", "runtime/backends/launcher.c")


def compile_inputs_digest(*extra: str) -> str:
    """sha256 over everything that shapes a compiled artifact: COMPILE_SOURCES (Python, C and
    the preset JSON), TVM's version and `extra`. Any change to any of them is a different key, so a
    cached build is never stale."""
    import tvm

    h = hashlib.sha256(tvm.__version__.encode())
    for src in COMPILE_SOURCES:
        path = PACKAGE / src
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.suffix in (".py", ".json", ".c") and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(PACKAGE)).encode())
                h.update(f.read_bytes())
    for x in extra:
        h.update(x.encode())
    return h.hexdigest()[:24]


def artifact_cache_root() -> Path:
    """DSV41_TEST_CACHE, else ~/.cache/dsv41-tests: compiled test artifacts survive the run (CI
    makes a fresh venv per run, the compile of the same code is not repeated)."""
    root = os.environ.get("DSV41_TEST_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "dsv41-tests"


@pytest.fixture(scope="session")
def small_artifact(small_case):
    """shared-small's artifact with ARTIFACT_ENTRIES (`cached_artifact`)."""
    from dsv41.graph.config import load_config

    return cached_artifact(load_config(small_case.checkpoint), "shared-small", ARTIFACT_ENTRIES)


def cached_artifact(args, model_name: str, entries: tuple[str, ...], target: str = "cpu") -> Path:
    """An artifact of `entries` for `args` and `target` (CUDA targets build real SASS without a
    GPU): reused from the cache when the code, the config, the entries, the target and TVM are
    the same (its manifest verified on load like any artifact), else compiled and put there
    (renamed in whole, so a killed run leaves no partial entry)."""
    # a CPU build's key is what it was before targets were named (the caches stay valid)
    key = compile_inputs_digest(args.config_hash(), ",".join(entries),
                                *(() if target == "cpu" else (target,)))
    cache = artifact_cache_root() / "artifacts"
    cache.mkdir(parents=True, exist_ok=True)
    locks = artifact_cache_root() / "locks"
    locks.mkdir(exist_ok=True)
    # one compile per key at a time: another test process (pytest -n) waits, then reuses it
    with open(locks / key, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        in_use(locks, key)  # before the path is handed out: no other process evicts it now
        return _cached_or_compiled(cache, locks, key, args, model_name, entries, target)


@functools.cache
def in_use(locks: Path, key: str):
    """A shared lock on the cached build `key` for the rest of this process (the open file is
    the cache's value): its tests hold the path for their session, so an eviction by another
    test process (`evict_unused`) must pass it over while any process holds it."""
    handle = open(locks / f"{key}.in-use", "w")  # noqa: SIM115 (held until the process ends)
    fcntl.flock(handle, fcntl.LOCK_SH)
    return handle


def evict_unused(cache: Path, locks: Path) -> None:
    """The cached builds past the ARTIFACT_CACHE_KEEP most recently used, but none that a test
    process holds (`in_use`): a build is removed only under its exclusive lock."""
    done = sorted((d for d in cache.iterdir() if (d / "done").is_file()),
                  key=lambda d: (d / "done").stat().st_mtime)
    for old in done[:-ARTIFACT_CACHE_KEEP]:
        with open(locks / f"{old.name}.in-use", "w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a test process runs on it
            shutil.rmtree(old, ignore_errors=True)


def _cached_or_compiled(cache: Path, locks: Path, key: str, args, model_name: str,
                        entries: tuple[str, ...], target: str) -> Path:
    from dsv41.compiler.build import CompileOptions, compile_artifact

    done = cache / key
    if (done / "done").is_file():
        os.utime(done / "done")  # most recently used
        return done / (done / "done").read_text()
    work = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=cache))
    # the entries in two processes at once (the pipeline is one thread; same libraries)
    opts = CompileOptions(args=args, model_name=model_name, target=target, out=work,
                          entries=entries, jobs=min(2, os.cpu_count() or 1))
    report = compile_artifact(opts)
    print({e: round(sum(t.values()), 1) for e, t in report.seconds.items()})
    # the artifact's path inside the entry, so the cache folder may move
    (work / "done").write_text(str(report.artifact_dir.relative_to(work)))
    try:
        os.rename(work, done)
    except OSError:  # another run finished the same key first: use its build
        shutil.rmtree(work, ignore_errors=True)
    evict_unused(cache, locks)
    for partial in cache.glob("*.*"):  # the work folders of killed runs, a day on
        if time.time() - partial.stat().st_mtime > 86400:
            shutil.rmtree(partial, ignore_errors=True)
    return done / (done / "done").read_text()


# ---- a redis-server of the test's own (runtime/redis_server.py) --------------------------------

REQUIRE_REDIS = "DSV41_REQUIRE_REDIS"  # set (by .ci/run): a missing redis-server fails the tests


def redis_or_skip() -> None:
    """Skip (with the reason) when redis-server is not installed; fail instead under
    DSV41_REQUIRE_REDIS=1, so CI never passes by skipping them."""
    from dsv41.runtime.tiers.redis_server import redis_binary

    if redis_binary() is None:
        msg = "redis-server is not installed (apt-get install -y redis-server)"
        if os.environ.get(REQUIRE_REDIS) == "1":
            pytest.fail(f"{msg}, and {REQUIRE_REDIS}=1 requires it.")
        pytest.skip(msg)


def worker_port() -> int:
    """A free port for a server a test starts, from this xdist worker's own band below the
    kernel's ephemeral range (PORT_BASE + PORT_BAND * worker index). A port the kernel hands
    out (`bind(('', 0))`, an outgoing connection) can be taken by another worker's test or
    connection before the server binds it, and a client would then talk to that other server;
    no other worker and no ephemeral port ever falls in this band."""
    import random
    import socket

    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    base = PORT_BASE + PORT_BAND * index
    start = random.randrange(PORT_BAND)
    for k in range(PORT_BAND):
        port = base + (start + k) % PORT_BAND
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"No free port in {base}..{base + PORT_BAND - 1}.")


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server on a free port of this worker's band (`worker_port`) in the test's
    folder; the test may kill, restart and fill it. Stopped at the end."""
    from dsv41.runtime.tiers.redis_server import RedisServer

    redis_or_skip()
    server = RedisServer.start(tmp_path / "redis", port=worker_port())
    yield server
    server.stop()
