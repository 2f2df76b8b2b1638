"""`GET /v1/models`: the one model served, with its context length."""

from __future__ import annotations

from fastapi import APIRouter, Request

from dsv41.runtime.serving.state import AppState


def models_router(st: AppState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request):
        st.metrics.count_request("models")
        st.check_key(request)
        return {"object": "list", "data": [
            {"id": st.opts.model_name, "object": "model", "created": st.created,
             "owned_by": "dsv41", "max_model_len": st.opts.max_seq_len}]}

    return router
