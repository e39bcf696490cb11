"""The Renderer room: chat templates to prompt ids, a thin deployment over deployments/chat_format/ (and
image input, vision/)."""
