"""The Ingress room: the graph's HTTP surface, one FastAPI app per replica.

deployment.py  the Ray Serve deployment: builds the app over handles to the Renderer, Scheduler,
               ResponseStore and (with --slide) Slide deployments, and reloads the API keys when asked.
app.py         the FastAPI app: every family's routers over one ServingContext, the request bodies
               /openapi.json documents, the error handlers, auth and the body limit.

API families, one folder each, each shaped alike: routes.py (the FastAPI routes, thin: a route reads its
body through http/route.py's skeleton and hands the typed model on), models.py (the typed request bodies,
and how a body as sent is read into one), serving.py (what a route does), framing.py (the reply bodies and
streams). Families import the shared modules below them, never each other.
  openai/      POST /v1/chat/completions and /v1/completions (logprobs.py, prompt_logprobs.py, echo.py:
               vLLM's extras; chat_reply.py: a chat reply's parts in OpenAI's shapes)
  anthropic/   POST /v1/messages and /v1/messages/count_tokens (translate.py: a Messages body as its chat
               completion)
  responses/   POST /v1/responses, GET and DELETE /v1/responses/{id} (translate.py: input items as chat
               messages, and a reply as the turn a stored response adds)
  decisions/   POST /v1/decisions (prompt.py: how each question is worded)
  ops/         the operators' routes: /v1/models, /health, /memory, /metrics, /dashboard and /stats,
               /tokenize and /detokenize, the imprint routes (health.py, memory.py, metrics.py and
               dashboard.py build their bodies)
  slide/       /v1/slide (--slide): the routes, bodies and framing; each learn or delete is the Slide
               room's (deployments/slide/), streamed back as typed events

Shared modules, what several families use (each imports only those listed after it):
  chat_run.py           the one chat handler: render a ChatCompletionRequest, build and start its request
                        (the grammar a reply runs under once rendered: a forced call's, gated after thinking)
  engine_request.py     a validated body, its prompt ids and what the reply asks to the one EngineRequest
  generation.py         one request's generation: start (refusals first), stream, finish, the finish log
                        (the stream read by deployments/engine_client/engine_reply.py)
  context.py            what every route of a replica shares: backend, settings, the engine's facts
  chat_request.py       the typed chat completion body every chat-shaped family runs as
  request_fields.py     the typed fields chat and completions share (logprobs included), and the fields
                        and combinations they refuse
  tool_checks.py        function tool definitions checked as each family's vendor checks them
  readiness.py          whether a Scheduler replica answers yet
  backend.py            what the routes need from the rest of the graph (Serve handles, or in-process)
  http/                 auth and keys, body limits, error envelopes, the route skeleton and key label, SSE,
                        the finish log and escaping, the request bodies in /openapi.json
  usage.py              a finished reply's figures: usage, the runtime block, the token digest
  sampling_fields.py    validators for the numeric and flag fields
  grammar_fields.py     structured-output fields, typed: checked and compiled to one grammar at parse time
  field_paths.py        where a refusal points: a validator's path below its field, joined to the field's
                        place in the body (`tools[2].function.parameters`)

pyproject.toml's Ingress layers contract keeps these imports running one way.
"""
