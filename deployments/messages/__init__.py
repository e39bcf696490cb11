"""Every type that crosses a process or deployment boundary, declared once (docs/structure.md).

A file per boundary: `requests` and `replies` (Ingress <-> Scheduler), `render` (Ingress <-> Renderer),
`status`, `counters` and `memory` (Scheduler -> Ingress snapshots), `engine_process` (a Scheduler replica
<-> its engine, on a thread or in a child process), `step` (Scheduler -> model ranks),
`prefix` (block names shared by the router, the engine and the store), `store` (engine <-> PromptStore),
`responses` (Ingress <-> ResponseStore), `slide` (living weights); `calls` is what every typed call across
them is. Nothing here imports torch or the engine.
"""
