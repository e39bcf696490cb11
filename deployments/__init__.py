"""The deployments of the graph and what they share: a room per deployment (ingress, renderer, scheduler,
response_store, slide) over the shared parts (model_rank, prompt_store, chat_format, routing,
engine_client) over the types that cross a boundary (messages) and four plain modules (config, tokenizer,
log_setup, serve_sockets).

A room never imports another room: rooms talk over Serve handles with the types in `deployments/messages/`
(docs/structure.md, the import contracts).
"""
