"""What every route of Ingress shares: auth and keys, body limits, error envelopes, SSE, the finish log."""
