"""The API-key label of the request being handled, for per-key request counts (never the key itself).

Auth puts the label on `request.state.key_label`; the route copies it into this context variable, so the
EngineRequest built deeper in the same task carries it without threading the HTTP request through.
"""

from contextvars import ContextVar

from starlette.requests import Request

NO_KEY = "none"
_key_label: ContextVar[str] = ContextVar("tensorfold_key_label", default=NO_KEY)


def capture_key_label(http: Request) -> None:
    label = getattr(http.state, "key_label", None)
    _key_label.set(label if isinstance(label, str) and label else NO_KEY)


def current_key_label() -> str:
    return _key_label.get()
