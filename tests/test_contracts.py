"""The typed contracts each backend implements with one set of signatures: `Phases` (the graph,
a compiled artifact and the torch.compile peer), `EntryBackend` (an artifact and the peer's
entries), `StorageTier` (the SSD store and its writer, the DRAM pool, the Redis pool), `Frontend`
(the continuous batcher and the EPD gateway, what the OpenAI server serves) with its
`EventStream` (their streams), `ArtifactSource` (the compiler's, for the serving assembly). A method
whose parameters (names, kinds, defaults, annotations) or return annotation drift from the
protocol's fails here, before any caller meets the difference."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from dsv41.compiler.tools.assets import CompilingSource
from dsv41.compiler.tools.bench.torch_peer import TorchCompiledEntries
from dsv41.graph.phases_api import GraphPhases, Phases
from dsv41.runtime.backends.artifact import Artifact
from dsv41.runtime.backends.compiled import CompiledPhases, EntryBackend
from dsv41.runtime.engine.planner import Holds, Level, Offloaded, TurnPlan, TurnPlanner
from dsv41.runtime.engine.records import Tier
from dsv41.runtime.serving.assembly import ArtifactSource
from dsv41.runtime.serving.batcher import Batcher, Stream
from dsv41.runtime.serving.epd_gateway import EpdGateway, RemoteStream
from dsv41.runtime.serving.frontend import EventStream, Frontend
from dsv41.runtime.tiers.base import StorageTier
from dsv41.runtime.tiers.block_writer import BlockWriter
from dsv41.runtime.tiers.dram_pool import SnapshotPool
from dsv41.runtime.tiers.redis_pool import RedisSnapshotPool
from dsv41.runtime.tiers.ssd_store import KVStore, model_fingerprint


def protocol_members(protocol) -> list[str]:
    own = {n for n in vars(protocol) if not n.startswith("_")}
    return sorted(n for n in own if callable(vars(protocol)[n])
                  or isinstance(vars(protocol)[n], property))


def signature_drift(protocol, impl, *, returns: bool = True) -> list[str]:
    """Every way `impl`'s public methods differ from `protocol`'s (empty when they agree)."""
    out = []
    for name in protocol_members(protocol):
        want = vars(protocol)[name]
        got = inspect.getattr_static(impl, name, None)
        if got is None:
            out.append(f"{impl.__name__} lacks {name}")
            continue
        if isinstance(want, property):
            if not isinstance(got, property):
                out.append(f"{impl.__name__}.{name} is not a property")
            continue
        a, b = inspect.signature(want), inspect.signature(got)
        if not returns:  # a generic protocol: each implementation names its own entry / stats
            a, b = a.replace(return_annotation=a.empty), b.replace(return_annotation=b.empty)
        if a != b:
            out.append(f"{impl.__name__}.{name}{b} != {protocol.__name__}.{name}{a}")
    return out


PHASES = ["prefill_exact", "decode_step", "draft_after", "verify_step", "encoder_prefill",
          "encoder_replay", "encode_cached_tail", "decoder_replay", "ced_prefill",
          "replay_prefill", "resume_prefill", "encode_image", "check_images"]


def test_the_phases_protocol_names_every_phase():
    assert protocol_members(Phases) == sorted(PHASES)


@pytest.mark.parametrize("impl", [GraphPhases, CompiledPhases])
def test_every_phases_backend_has_the_protocols_signatures(impl):
    """The graph and the compiled phases (which the torch.compile peer of `dsv41 bench` runs
    over its own entries) agree with `Phases` on every method."""
    assert signature_drift(Phases, impl) == []


@pytest.mark.parametrize("impl", [Artifact, TorchCompiledEntries])
def test_every_entry_backend_has_the_protocols_signatures(impl):
    assert protocol_members(EntryBackend) == ["bind", "call", "entries"]
    assert signature_drift(EntryBackend, impl) == []


def test_a_drifting_signature_is_caught():
    """The check itself: a parameter renamed, a default changed or a method missing is a
    difference."""

    class Renamed(GraphPhases):
        def decode_step(self, model, cache, tokens, *, drafts: bool = False):
            raise AssertionError

    class Defaulted(GraphPhases):
        def check_images(self, model=None) -> None:
            raise AssertionError

    assert [d.split("(")[0] for d in signature_drift(Phases, Renamed)] == \
        ["Renamed.decode_step"]
    assert [d.split("(")[0] for d in signature_drift(Phases, Defaulted)] == \
        ["Defaulted.check_images"]
    assert signature_drift(Phases, object) == [f"object lacks {n}" for n in sorted(PHASES)]


def test_the_graph_phases_are_phases():
    assert isinstance(GraphPhases(), Phases)


@pytest.mark.parametrize("impl", [KVStore, BlockWriter, SnapshotPool, RedisSnapshotPool])
def test_every_storage_tier_has_the_protocols_signatures(impl):
    assert protocol_members(StorageTier) == ["close", "contains", "drop", "get", "put", "stats"]
    assert signature_drift(StorageTier, impl, returns=False) == []


def test_the_ssd_store_its_writer_and_the_dram_pool_are_tiers(tmp_path):
    fp = model_fingerprint("cfg", "weights", 1)
    store = KVStore(tmp_path, capacity_bytes=1 << 20, fingerprint=fp)
    writer = BlockWriter(store)
    try:
        for tier in (store, writer, SnapshotPool(budget_bytes=1 << 20)):
            assert isinstance(tier, StorageTier), type(tier).__name__
    finally:
        writer.close()
        store.close()


def test_the_frontend_protocol_names_what_the_server_uses():
    """create_app and its routers call `submit` and `stats` on the frontend, and `get`,
    `cancel` and `timing` on the streams it returns: nothing else."""
    assert protocol_members(Frontend) == ["stats", "submit"]
    assert protocol_members(EventStream) == ["cancel", "get", "timing"]


@pytest.mark.parametrize("impl", [Batcher, EpdGateway])
def test_every_frontend_has_the_protocols_signatures(impl):
    """Parameters alike; `submit` returns each frontend's own stream class (an `EventStream`,
    checked below), `stats` the one BatcherStats."""
    assert signature_drift(Frontend, impl, returns=False) == []
    assert inspect.signature(impl.stats).return_annotation == \
        inspect.signature(Frontend.stats).return_annotation == "BatcherStats"


@pytest.mark.parametrize("impl", [Stream, RemoteStream])
def test_every_frontends_stream_has_the_protocols_signatures(impl):
    assert signature_drift(EventStream, impl) == []


def test_a_drifting_frontend_is_caught():
    """A renamed parameter, a dropped default, a plain method for a property, a member gone."""

    class Renamed(Batcher):
        def submit(self, prompt_ids, params, image=()):
            raise AssertionError

    class NoImages(EpdGateway):
        def submit(self, prompt_ids, params):
            raise AssertionError

    class TimingCalled(Stream):
        def timing(self):
            raise AssertionError

    assert [d.split("(")[0] for d in signature_drift(Frontend, Renamed, returns=False)] == \
        ["Renamed.submit"]
    assert [d.split("(")[0] for d in signature_drift(Frontend, NoImages, returns=False)] == \
        ["NoImages.submit"]
    assert signature_drift(EventStream, TimingCalled) == ["TimingCalled.timing is not a property"]
    assert signature_drift(Frontend, object) == ["object lacks stats", "object lacks submit"]


def test_the_compilers_artifact_source_is_one():
    assert protocol_members(ArtifactSource) == ["artifact", "checkpoint"]
    assert signature_drift(ArtifactSource, CompilingSource) == []


@pytest.mark.parametrize("result", [TurnPlan, Offloaded, Level])
def test_the_planners_results_are_frozen_typed_dataclasses(result):
    """The planner answers with small frozen records (never tuples), every field typed."""
    assert dataclasses.is_dataclass(result) and result.__dataclass_params__.frozen
    fields = dataclasses.fields(result)
    assert fields and all(f.type not in (None, "", inspect.Parameter.empty) for f in fields)
    hints = typing.get_type_hints(result)
    assert set(hints) == {f.name for f in fields}


def test_the_turn_plan_fields_and_the_planners_signatures():
    assert [f.name for f in dataclasses.fields(TurnPlan)] == ["cache", "tier", "cached", "keys",
                                                              "stored_blocks"]
    assert typing.get_type_hints(TurnPlan)["tier"] is Tier
    restore = inspect.signature(TurnPlanner.restore)
    assert list(restore.parameters) == ["self", "keyed", "live", "live_tokens", "resumed"]
    assert restore.return_annotation == "TurnPlan"
    offload = inspect.signature(TurnPlanner.offload)
    assert list(offload.parameters) == ["self", "cache", "history", "images", "session",
                                        "holder", "stored_blocks", "previous"]
    assert offload.return_annotation == "Offloaded"


def test_the_restore_order_is_one_table_of_levels():
    """Live first, cold last; the state levels before the blocks alone; exact mode keeps SSD
    state records instead of prefix blocks; no SSD store: only live and cold."""
    from dsv41.runtime.engine.options import EngineOptions
    from dsv41.runtime.engine.planner import tier_levels

    pool, ssd = object(), object()
    ced = tier_levels(EngineOptions(), pool, ssd)
    assert [lv.tier for lv in ced] == [Tier.LIVE, Tier.SNAPSHOT, Tier.PREFIX, Tier.COLD]
    assert [lv.holds for lv in ced] == [Holds.CACHE, Holds.STATE, Holds.BLOCKS, Holds.NOTHING]
    assert ced[1].source is pool and ced[2].source is ssd
    exact = tier_levels(EngineOptions(exact=True), pool, ssd)
    assert [lv.tier for lv in exact] == [Tier.LIVE, Tier.SNAPSHOT, Tier.SNAPSHOT_SSD, Tier.COLD]
    assert exact[2].source is ssd
    assert [lv.tier for lv in tier_levels(EngineOptions(), pool, None)] == [Tier.LIVE, Tier.COLD]
