"""The artifact's parallel launcher (`runtime.backends.launcher`): the same results as TVM's pool,
bit for bit; a task's error raised on the caller; concurrent callers, nesting-free serial
fallback and fork; installed by an artifact's entries and sized with TVM's pool."""

import os
import threading

import numpy as np
import pytest
import torch

from dsv41.compiler.launcher import build_launcher
from dsv41.runtime.backends.launcher import (
    ABI,
    LAUNCHER_FILE,
    Launcher,
    LauncherCounts,
    LauncherError,
    launchers,
    spin_us,
)

ROWS, COLS = 96, 200


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A launcher library and a kernel library with one parallel loop over rows (row r of y:
    a function of row r of x, after `work[r]` more steps; the loop `assert`s that x[r, 0] is
    not negative), both loaded."""
    import tvm
    from tvm.script import tirx as T

    d = tmp_path_factory.mktemp("launcher")

    @T.prim_func(s_tir=True)
    def rows(x: T.Buffer((ROWS, COLS), "float32"), work: T.Buffer((ROWS,), "int32"),
             y: T.Buffer((ROWS, COLS), "float32")):
        T.func_attr({"global_symbol": "rows", "tirx.noalias": True})
        for r in T.parallel(ROWS):
            assert x[r, 0] >= T.float32(0), "row starts negative"
            for c in range(COLS):
                y[r, c] = T.sqrt(x[r, c] * x[r, c] + T.float32(1)) * T.float32(1.5) + x[r, 0]
                for _ in range(work[r]):  # busy rows: keep their task's thread a while
                    y[r, c] = T.sqrt(y[r, c] + T.float32(1))

    lib = d / "rows.so"
    tvm.compile(tvm.IRModule({"rows": rows}), target="llvm").export_library(str(lib))
    module = tvm.runtime.load_module(str(lib))
    launcher = Launcher(build_launcher(d))
    launcher.configure(2, 50)
    yield launcher, lib, module["rows"]
    launcher.uninstall(lib)


def run(func, x: np.ndarray, busy_rows: int = 0) -> np.ndarray:
    """The kernel on x; its first `busy_rows` rows take ~20,000 more steps each."""
    import tvm

    work = np.zeros(ROWS, np.int32)
    work[:busy_rows] = 100
    y = tvm.runtime.tensor(np.zeros_like(x))
    func(tvm.runtime.tensor(x), tvm.runtime.tensor(work), y)
    return y.numpy()


def rows_input(seed: int) -> np.ndarray:
    return np.abs(np.random.default_rng(seed).standard_normal((ROWS, COLS))).astype(np.float32)


def test_results_are_tvm_pools_bit_for_bit(built):
    launcher, lib, func = built
    x = rows_input(0)
    launcher.uninstall(lib)
    assert not launcher.installed(lib)
    theirs = run(func, x)
    assert launcher.install(lib) and launcher.installed(lib)
    before = launcher.counts()
    ours = run(func, x)
    after = launcher.counts()
    assert ours.tobytes() == theirs.tobytes()
    assert after.pooled == before.pooled + 1  # the pool ran it (two threads, two tasks)
    want = np.sqrt(x * x + np.float32(1)) * np.float32(1.5) + x[:, :1]
    np.testing.assert_allclose(ours, want, rtol=1e-6)


@pytest.mark.parametrize("bad_row", [0, ROWS - 1])
def test_a_tasks_error_is_raised_on_the_caller_and_the_pool_goes_on(built, bad_row):
    """Two tasks of 48 rows; the first task's rows are busy, so the caller claims it and is
    still in it when the worker claims the second: row 0 fails on the caller, the last row on
    the worker (whose error TVM would not see: it reads the caller's thread's)."""
    launcher, lib, func = built
    launcher.install(lib)
    x = rows_input(1)
    x[bad_row, 0] = -1.0
    for _ in range(3):
        with pytest.raises(Exception, match="row starts negative"):
            run(func, x, busy_rows=ROWS // 2)
    good = rows_input(2)
    launcher.uninstall(lib)
    theirs = run(func, good)
    launcher.install(lib)
    assert run(func, good).tobytes() == theirs.tobytes()


def test_concurrent_callers_each_get_their_own_results(built):
    """Callers on four threads at once: one holds the pool, the others run serially; every
    result is its own input's."""
    launcher, lib, func = built
    launcher.install(lib)
    inputs = [rows_input(10 + i) for i in range(4)]
    launcher.uninstall(lib)
    want = [run(func, x) for x in inputs]
    launcher.install(lib)
    before = launcher.counts()
    bad: list[int] = []

    def caller(i: int) -> None:
        for _ in range(40):
            if run(func, inputs[i]).tobytes() != want[i].tobytes():
                bad.append(i)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = launcher.counts()
    assert bad == []
    assert (after.pooled - before.pooled) + (after.serial - before.serial) == 160


def test_a_forked_child_starts_its_own_workers(built):
    launcher, lib, func = built
    launcher.install(lib)
    x = rows_input(3)
    want = run(func, x)
    pid = os.fork()
    if pid == 0:  # the child: its parent's workers do not exist here
        code = 1
        try:
            before = launcher.counts()
            ok = run(func, x).tobytes() == want.tobytes()
            code = 0 if ok and launcher.counts().pooled == before.pooled + 1 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_resizing_to_one_thread_runs_serially(built):
    launcher, lib, func = built
    launcher.install(lib)
    x = rows_input(4)
    want = run(func, x)
    try:
        assert launcher.configure(1, 50) == 1
        before = launcher.counts()
        assert run(func, x).tobytes() == want.tobytes()
        assert launcher.counts() == LauncherCounts(before.pooled, before.serial + 1)
    finally:
        assert launcher.configure(2, 50) == 2


def test_not_a_launcher_is_refused(built, tmp_path):
    _, lib, _ = built
    with pytest.raises(LauncherError, match="is not a dsv41 launcher library"):
        Launcher(lib)
    with pytest.raises(LauncherError, match="is not loaded in this process"):
        Launcher(build_launcher(tmp_path)).install(tmp_path / "absent.so")
    assert ABI == 1


def test_spin_setting(monkeypatch):
    monkeypatch.setenv("DSV41_LAUNCHER_SPIN_US", "20")
    assert spin_us() == 20
    for bad in ("fast", "-1"):
        monkeypatch.setenv("DSV41_LAUNCHER_SPIN_US", bad)
        with pytest.raises(ValueError, match="DSV41_LAUNCHER_SPIN_US must be"):
            spin_us()
    monkeypatch.setenv("DSV41_LAUNCHER", "openmp")
    from dsv41.runtime.backends.launcher import use_artifact_launcher

    with pytest.raises(ValueError, match="DSV41_LAUNCHER must be 'artifact' or 'tvm', got "
                                         "'openmp'."):
        use_artifact_launcher()


def test_an_artifacts_entries_run_on_its_launcher(small_artifact, small_model):
    """The CPU artifact carries the launcher (a checksummed file); its decode entry runs on it,
    and gives the very logits of TVM's pool; TVM's pool size is the launcher's."""
    from dsv41.graph.cache import new_cache
    from dsv41.runtime.backends.artifact import Artifact
    from dsv41.runtime.backends.compiled import CompiledPhases
    from dsv41.runtime.backends.threads import pool_config, size_tvm_pool, tvm_num_threads

    art = Artifact.load(small_artifact, args=small_model.args)
    assert LAUNCHER_FILE in art.manifest.files
    ph = CompiledPhases(art, small_model)
    toks = torch.tensor([[5, 6, 7, 8, 9, 10]])

    def logits() -> torch.Tensor:
        cache = new_cache(small_model.plan, 1, 64, engram_pad=small_model.engram.pad_id)
        return ph.ced_prefill(small_model, cache, toks).logits

    first = logits()
    libraries = [small_artifact / f"{e}.so" for e in art.entries]
    # launchers are shared by content: one loaded first from another artifact with the same
    # launcher file (an earlier test in this process) is this artifact's too
    (launcher,) = [x for x in launchers().all() if any(x.installed(lib) for lib in libraries)]
    assert launcher.path.read_bytes() == (small_artifact / LAUNCHER_FILE).read_bytes()
    ran = [lib for lib in libraries if launcher.installed(lib)]
    assert ran, "no entry runs on the artifact's launcher"
    assert pool_config().launcher == "artifact"
    n = tvm_num_threads()
    before = launcher.counts()
    ours = logits()
    assert launcher.counts().pooled > before.pooled or n == 1
    for lib in ran:
        launcher.uninstall(lib)
    try:
        theirs = logits()
    finally:
        for lib in ran:
            launcher.install(lib)
    assert torch.equal(ours, theirs) and torch.equal(first, ours)
    try:
        size_tvm_pool(1)
        assert launcher.threads == 1
    finally:
        size_tvm_pool(n)
    assert launcher.threads == n


def test_a_launcher_that_cannot_load_leaves_the_entries_on_tvms_pool(small_artifact, small_model,
                                                                     monkeypatch):
    """A launcher library this runtime cannot use (another ABI, a libc it cannot load) is a
    warning, not a failure: the entries run on TVM's pool, with the same results."""
    from dsv41.graph.cache import new_cache
    from dsv41.runtime.backends import launcher as launcher_module
    from dsv41.runtime.backends.artifact import Artifact
    from dsv41.runtime.backends.compiled import CompiledPhases

    def refuse(self, path, digest, threads):
        raise LauncherError(f"{path} is launcher ABI 99; this runtime installs 1.")

    toks = torch.tensor([[5, 6, 7, 8, 9, 10]])

    def logits(art) -> torch.Tensor:
        cache = new_cache(small_model.plan, 1, 64, engram_pad=small_model.engram.pad_id)
        return CompiledPhases(art, small_model).ced_prefill(small_model, cache, toks).logits

    want = logits(Artifact.load(small_artifact, args=small_model.args))
    monkeypatch.setattr(launcher_module.Launchers, "get", refuse)
    with pytest.warns(RuntimeWarning, match="launcher ABI 99; this runtime installs 1.*run on "
                                            "TVM's thread pool"):
        got = logits(Artifact.load(small_artifact, args=small_model.args))
    assert torch.equal(got, want)
