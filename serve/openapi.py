"""/openapi.json that tells the truth: the handlers read and validate their bodies themselves (with
bounded work, `lcx.serve.body`), so FastAPI cannot see them; each POST route declares its body
model here (`post_doc`), and `install_openapi` puts those models in the document's components.
Every route lists the OpenAI error object for the statuses it can answer with."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .protocol import ErrorResponse

REF = "#/components/schemas/{model}"
_BODY_MODELS: list[type[BaseModel]] = []  # every model a route declared with `post_doc`

_ERRORS = {
    400: "invalid request: the error names the field (`param`)",
    401: "missing or invalid API key (only when the server has one)",
    404: "unknown model name",
    408: "the body did not arrive within the server's body timeout",
    413: "body larger than the server's limit, or holding more values than any valid request",
    415: "Content-Type other than application/json",
    500: "the engine failed on this request (a server bug)",
    503: "the engine is not running (its process died): requests in flight and new ones get this; see /health",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries: OpenAI's error object for each status."""
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def post_doc(body: type[BaseModel], *, stream: bool = False, generates: bool = False) -> dict[str, Any]:
    """The route-decorator keywords documenting a POST route whose handler validates `body` itself:
    the request body, the error responses (`generates`: the route runs the engine, so 503 when
    its process is gone) and (`stream`) the text/event-stream alternative."""
    if body not in _BODY_MODELS:
        _BODY_MODELS.append(body)
    ok: dict[str, Any] = {"description": "the response"}
    if stream:
        ok = {"description": "the response; with stream=true a text/event-stream of chunks of the same shape, "
                             "ended by `data: [DONE]`",
              "content": {"text/event-stream": {"schema": {
                  "description": "server-sent events, each `data: <chunk as JSON>`, the last `data: [DONE]`"}}}}
    return {
        "openapi_extra": {"requestBody": {
            "required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=body.__name__)}}}}},
        "responses": {200: ok, **errors(400, 401, 404, 408, 413, 415, 500, *((503,) if generates else ()))},
    }


def install_openapi(app: FastAPI, *, description: str) -> None:
    """`app.openapi` builds FastAPI's document, then adds the declared body models to its
    components and drops the 422 FastAPI attaches to path parameters (errors are 400 here)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=description, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in _BODY_MODELS], ref_template=REF)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in defs.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for item in doc.get("paths", {}).values():
            for op in item.values():
                op.get("responses", {}).pop("422", None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
