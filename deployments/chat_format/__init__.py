"""Chat formats, shared by the Renderer and Ingress: templates, reply parsing, forced calls, think markup."""
