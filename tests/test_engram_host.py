"""Host-resident Engram (`runtime.engram_host`): the host function a compiled entry calls for an
Engram layer's rows, posted gathers with prefetch on and off, and the compiled shared-small
artifact with its tables in host memory: the manifest's host marks, identical outputs with
prefetch on and off, and the rows counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm_ffi

from dsv41.graph.engram import engram_table_layer, host_resident
from dsv41.graph.ops import ENGRAM_ROWS_FUNC, engram_rows
from dsv41.runtime.backends.device import Device, DeviceKind
from dsv41.runtime.backends.engram_host import EngramPrefetcher, EngramTable, engram_board
from dsv41.runtime.backends.tensors import to_torch, to_tvm
from dsv41.runtime.engine import Engine

CPU = Device(DeviceKind.CPU)


def _tables(rows=(50, 70), ed=64, seed=0) -> tuple[EngramTable, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(EngramTable(slot, torch.randint(0, 256, (n, ed), dtype=torch.uint8, generator=g),
                             torch.randint(100, 140, (n, ed // 32), dtype=torch.uint8,
                                           generator=g))
                 for slot, n in enumerate(rows))


def _ids(b=2, s=5, cols=6, rows=(50, 70), seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (b, s, cols), generator=g) for n in rows], dim=2)


def _call(ids: torch.Tensor, table: EngramTable):
    """What a compiled entry does at the layer: the registered host function on tvm tensors."""
    f = tvm_ffi.get_global_func(ENGRAM_ROWS_FUNC)
    codes, scales = f(to_tvm(ids), table.slot, to_tvm(table.codes), to_tvm(table.scales))
    return to_torch(codes), to_torch(scales)


@pytest.mark.parametrize("prefetch", [True, False])
def test_posted_gathers_give_the_oracle_rows(prefetch):
    tables, ids = _tables(), _ids()
    pre = EngramPrefetcher(CPU, prefetch=prefetch)
    keys = pre.post(ids, tables)
    assert len(keys) == 2
    for t in tables:
        codes, scales = _call(ids, t)
        want = engram_rows(ids, t.slot, t.codes, t.scales)
        assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
        assert codes.shape == (2, 5, 6, 64) and scales.shape == (2, 5, 6, 2)
    pre.finish(keys)
    timing = pre.reset_timing()
    assert (timing.calls, timing.rows, timing.bytes) == (1, 2 * 60, 2 * 60 * (64 + 2))
    assert timing.gather_s > 0 and timing.wait_s >= 0
    if not prefetch:  # the gather ran inside the claim: nothing hidden
        assert timing.wait_s >= timing.gather_s
    assert pre.timing.calls == 0  # reset


def test_a_claim_without_a_posted_gather_is_refused():
    tables, ids = _tables(), _ids()
    engram_board()  # registers the function
    with pytest.raises(RuntimeError, match="no gather was posted"):
        _call(ids, tables[0])
    pre = EngramPrefetcher(CPU)
    keys = pre.post(ids, tables)
    _call(ids, tables[0])
    with pytest.raises(RuntimeError, match="no gather was posted"):  # claimed once only
        _call(ids, tables[0])
    pre.finish(keys)  # the unclaimed slot-1 gather is dropped
    with pytest.raises(RuntimeError, match="no gather was posted"):
        _call(ids, tables[1])


def test_the_same_buffers_cannot_be_posted_twice_at_once():
    tables, ids = _tables(), _ids()
    pre = EngramPrefetcher(CPU)
    keys = pre.post(ids, tables)
    with pytest.raises(RuntimeError, match="posted for the same ids"):
        pre.post(ids, tables)
    pre.finish(keys)
    pre.finish(pre.post(ids, tables))  # free again after the first call finished


def test_the_hash_ids_stand_where_the_artifact_looks_for_them(small_model):
    from dsv41.graph.cache import new_cache
    from dsv41.graph.entries import HASH_IDS_AT, entry_inputs

    cache = new_cache(small_model.plan, 1, 64)
    ids = torch.zeros(1, 3, 2, 6, dtype=torch.int64)
    inputs = entry_inputs(small_model, cache, "prefill", torch.ones(1, 3, dtype=torch.int64),
                          hash_ids=ids)
    assert inputs[HASH_IDS_AT] is ids


def test_host_resident_names():
    assert host_resident("layers.1.engram.embed.weight")
    assert host_resident("layers__14__engram__embed__scale")
    assert not host_resident("layers.1.engram.wkv.weight")
    assert engram_table_layer("layers__14__engram__embed__weight") == 14
    assert engram_table_layer("layers.14.engram.embed.scale") is None
    assert engram_table_layer("layers.3.attn.wq_a.weight") is None


def test_the_artifact_reads_the_tables_and_ids_on_the_host(small_artifact):
    import json

    m = json.loads((small_artifact / "manifest.json").read_text())
    for entry, sig in m["entries"].items():
        host = sorted(p["param"] for p in sig["params"] if p.get("host"))
        assert host == sorted(p["param"] for p in sig["params"] if host_resident(p["param"])), \
            entry
        assert len(host) == 4, entry  # two Engram layers, codes and scales
        assert [i["name"] for i in sig["inputs"] if i.get("host")] == ["hash_ids"], entry


def test_prefetch_on_and_off_give_identical_outputs(small_artifact, small_case, tmp_path):
    """Two turns (a prefill, decode steps, a second prefill) on the compiled shared-small with
    the rows gathered ahead and inside the entry: the same logits bit for bit; every call's rows
    are counted (b * s * cols per Engram layer)."""
    rng = np.random.default_rng(5)
    turns = [[int(x) for x in rng.integers(3, 500, n)] for n in (29, 7)]
    out, rows = {}, {}
    for prefetch in (True, False):
        e = Engine.load(str(small_artifact), str(small_case.checkpoint), device="cpu",
                        engram_prefetch=prefetch, page_tokens=8)
        art = e.phases.art
        assert art.engram_prefetch is prefetch
        art.engram_timing(reset=True)
        s = e.session()
        for ids in turns:
            list(s.send(ids, max_new_tokens=3, keep_logits=True))
        out[prefetch] = [np.stack(t.logits) for t in s.turns]
        timing = art.engram_timing(reset=True)
        rows[prefetch] = timing.rows
        a = e.model.args
        cols = (a.engram_max_ngram_size - 1) * a.engram_n_heads
        assert timing.calls >= 1 + 2 + 1 + 2 and timing.gather_s > 0
        e.close()
    for a, b in zip(out[True], out[False], strict=True):
        assert np.array_equal(a, b)
    assert rows[True] == rows[False]
    assert rows[True] % (2 * cols) == 0 and rows[True] >= 2 * cols * (29 + 7)


def _cuda() -> Device:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU that torch can use on this machine")
    return Device(DeviceKind.CUDA, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [True, False])
def test_gpu_gathers_come_to_the_device_bit_for_bit(prefetch):
    dev = _cuda()
    from dsv41.runtime.backends.device import load_tvm_runtime_lib

    load_tvm_runtime_lib("tvm_runtime_cuda")
    tables, ids = _tables(), _ids()
    pre = EngramPrefetcher(dev, prefetch=prefetch)
    keys = pre.post(ids, tables)
    for t in tables:
        codes, scales = _call(ids, t)
        assert codes.device.type == "cuda"
        want = engram_rows(ids, t.slot, t.codes, t.scales)
        assert torch.equal(codes.cpu(), want[0]) and torch.equal(scales.cpu(), want[1])
    pre.finish(keys)


@pytest.mark.gpu
def test_gpu_transfers_round_trip_through_pinned_staging():
    from dsv41.runtime.engine.transfer import Transfers

    dev = _cuda().torch
    src = torch.randint(0, 256, (3, 40, 16), dtype=torch.uint8, device=dev)
    bf = torch.randn(5, 8, device=dev).to(torch.bfloat16)
    io = Transfers(dev)
    a, b = io.out(src[1]), io.out(bf)
    io.ready_for_host()
    assert np.array_equal(a, src[1].cpu().numpy())
    assert np.array_equal(b, bf.cpu().view(torch.uint16).numpy())
    dest, dest_bf = torch.zeros_like(src), torch.zeros_like(bf)
    io = Transfers(dev)
    io.into(a, dest[2])
    io.into(b, dest_bf)
    io.ready_for_compute()
    assert torch.equal(dest[2], src[1]) and torch.equal(dest_bf, bf)
    assert int(dest[:2].count_nonzero()) == 0


def test_cpu_transfers_copy_once_and_refuse_what_does_not_fit():
    from dsv41.runtime.engine.transfer import Transfers

    src = torch.arange(24, dtype=torch.int16).view(2, 3, 4).to(torch.bfloat16)
    bits = src[1].view(torch.uint16).numpy().copy()
    io = Transfers("cpu")
    a = io.out(src[1])
    io.ready_for_host()
    src[1, 0, 0] = 99  # the array is the caller's own copy
    assert a.dtype == np.uint16 and np.array_equal(a, bits)
    dest = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    io = Transfers("cpu")
    io.into(a, dest[0])
    io.ready_for_compute()
    assert torch.equal(dest[0], torch.from_numpy(a).view(torch.bfloat16))
    with pytest.raises(ValueError, match="do not fit"):
        io.into(a[:2], dest[0])
    with pytest.raises(ValueError, match="do not fit"):
        io.into(a.astype(np.int32), dest[0])
