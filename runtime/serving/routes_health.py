"""`GET /health`, `GET /version` (vLLM's shape, `{"version": ...}`: the installed dsv41's, with
the served model and the grammar engine's) and `GET /metrics` (Prometheus text through
prometheus_client, runtime/serving/metrics.py, the frontend's stats read at each scrape): open
without the API key, for load balancers and scrapers."""

from __future__ import annotations

from importlib.metadata import version

from fastapi import APIRouter
from fastapi.responses import Response

from dsv41.runtime.serving.metrics import CONTENT_TYPE
from dsv41.runtime.serving.state import AppState


def health_router(st: AppState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    @router.get("/version")
    async def server_version():
        return {"version": version("dsv41"), "model": st.opts.model_name,
                "llguidance": version("llguidance")}

    @router.get("/metrics")
    async def metrics_text():
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    return router
