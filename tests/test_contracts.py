"""The typed contracts each backend implements with one set of signatures: `Phases` (the graph,
a compiled artifact and the torch.compile peer), `EntryBackend` (an artifact and the peer's
entries). A method whose parameters (names, kinds, defaults, annotations) or return annotation
drift from the protocol's fails here, before any caller meets the difference."""

from __future__ import annotations

import inspect

import pytest

from dsv41.compiler.bench import TorchCompiledEntries
from dsv41.graph.phases_api import GraphPhases, Phases
from dsv41.runtime.artifact import Artifact
from dsv41.runtime.compiled import CompiledPhases, EntryBackend


def protocol_members(protocol) -> list[str]:
    own = {n for n in vars(protocol) if not n.startswith("_")}
    return sorted(n for n in own if callable(vars(protocol)[n])
                  or isinstance(vars(protocol)[n], property))


def signature_drift(protocol, impl) -> list[str]:
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
