"""GET /v1/models and /v1/models/{id}: the served models, one per pool (gateway.pools), in
OpenAI's shape plus ``max_model_len`` (vLLM's name: prompt + generated tokens one request may
reach) and ``pool``. Benchmark clients (aiperf's ``--wait-for-model-mode models``, guidellm
without ``--model``) and ``client.models.list()`` read the model name from here."""

from __future__ import annotations

from fastapi import APIRouter, Request

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [m.card() for m in await request.app.state.pool.models()]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict:
    """``model_id`` may contain slashes (a model path such as ``Qwen/Qwen2.5-7B-Instruct``)."""
    return (await request.app.state.pool.resolve(model_id)).card()
