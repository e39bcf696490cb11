"""What every generation route does on arrival and on refusal, in one place.

Arrival: stamp the wall clock (the request's `created` and its latency start) and note the caller's key
label for per-key metrics. Refusal: an APIError raised before any work is logged as `refused` with the
reply id and answered in the route's own error format.
"""

import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from deployments.ingress.http.errors import APIError
from deployments.ingress.http.finish_log import log_refused
from deployments.ingress.http.request_labels import capture_key_label


def arrive(http: Request) -> float:
    arrival = time.time()
    capture_key_label(http)  # per-key request counts (metrics)
    return arrival


ErrorFormat = Callable[[APIError], JSONResponse]  # the route's own envelope (OpenAI's by default)


def refusal(request_id: str, exc: APIError, respond: ErrorFormat = APIError.response) -> JSONResponse:
    log_refused(request_id, exc.status, exc.message)
    return respond(exc)
