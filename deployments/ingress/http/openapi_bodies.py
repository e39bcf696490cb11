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

_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer"},
    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}


def _with_bodies(spec: dict[str, Any], bodies: Mapping[str, type[BaseModel]], keys: bool) -> dict[str, Any]:
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        operation = spec.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        schema = model.model_json_schema(mode="validation", ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
        operation["requestBody"] = {"required": True, "content": content}
    if keys:
        spec["components"]["securitySchemes"] = _SCHEMES
        spec["security"] = [{"bearer": []}, {"apiKey": []}]
    return spec


def document_bodies(app: FastAPI, bodies: Mapping[str, type[BaseModel]], keys: bool) -> None:
    """Replace `app.openapi` with one that adds the bodies (built once, then cached like FastAPI's)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None or "x-bodies" not in app.openapi_schema:
            spec = _with_bodies(build(), bodies, keys)
            spec["x-bodies"] = True
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
