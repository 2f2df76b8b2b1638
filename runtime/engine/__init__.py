"""The engine: sessions, turns, the decode batch, the turn planner over the tiers, requests,
sampling, speculation, images and the cache state that moves between the device and the tiers.

The public face: `from dsv41.runtime.engine import Engine, EngineOptions, Session, ...`."""

from dsv41.graph.phases_api import PrefillPacing
from dsv41.runtime.engine.batch import DecodeBatch
from dsv41.runtime.engine.engine import Engine
from dsv41.runtime.engine.options import CacheFullError, EngineOptions
from dsv41.runtime.engine.planner import Offloaded, TurnPlan, TurnPlanner
from dsv41.runtime.engine.records import EngineStats, StateKind, Tier, TurnRecord
from dsv41.runtime.engine.session import Session
from dsv41.runtime.engine.turn import Turn

__all__ = ["CacheFullError", "DecodeBatch", "Engine", "EngineOptions", "EngineStats",
           "Offloaded", "PrefillPacing", "Session", "StateKind", "Tier", "Turn", "TurnPlan",
           "TurnPlanner", "TurnRecord"]
