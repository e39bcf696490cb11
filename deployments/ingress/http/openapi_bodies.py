"""The request bodies in /openapi.json, and the key schemes when keys are configured.

Routes read their bodies by hand (errors.py explains why), so FastAPI cannot see them; this fills each
documented path's requestBody from its pydantic model, so clients and fuzzers (the schemathesis test)
work from the real schema. Each API family names its paths' models (`REQUEST_BODIES` in its routes.py);
the app hands them all to `document_bodies`.
"""

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from deployments.ingress.http.openapi_errors import add_error_responses

_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer"},
    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}


def _served_models(schema: dict[str, Any], model_ids: list[str]) -> None:
    """A body's `model` may name only the served id or an alias (else 404), or be left out."""
    if "model" in schema.get("properties", {}):
        schema["properties"]["model"] = {"anyOf": [{"enum": model_ids}, {"type": "null"}], "default": None}


def _with_bodies(
    spec: dict[str, Any], bodies: Mapping[str, type[BaseModel]], keys: bool, model_ids: list[str]
) -> dict[str, Any]:
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        operations = spec.get("paths", {}).get(path, {})
        operation = operations.get("post") or operations.get("delete")  # a DELETE's body is optional
        if operation is None:
            continue
        schema = model.model_json_schema(mode="validation", ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        _served_models(schema, model_ids)
        components[model.__name__] = schema
        content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
        operation["requestBody"] = {"required": "post" in operations, "content": content}
    if keys:
        spec["components"]["securitySchemes"] = _SCHEMES
        spec["security"] = [{"bearer": []}, {"apiKey": []}]
    return spec


def document_bodies(
    app: FastAPI,
    bodies: Mapping[str, type[BaseModel]],
    keys: bool,
    model_ids: list[str],
    open_paths: tuple[str, ...] = (),
) -> None:
    """Replace `app.openapi` with one that adds the bodies and each operation's error statuses (built once,
    then cached like FastAPI's); `open_paths` answer without a key."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None or "x-bodies" not in app.openapi_schema:
            spec = _with_bodies(build(), bodies, keys, model_ids)
            add_error_responses(spec, keys, open_paths)
            spec["x-bodies"] = True
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
