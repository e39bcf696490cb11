"""What every route of Ingress shares: auth and keys, body limits, error envelopes, the route skeleton, SSE,
the finish log, and the request bodies in /openapi.json."""
