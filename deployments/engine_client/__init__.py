"""What a room that asks the graph's Renderer and Scheduler for work shares (Ingress's routes, the Slide room).

streams.py       a stream of items from another deployment (`ItemStream`, a Scheduler's `Upstream`), a
                 Serve handle's stream, and the wire settings every handle between rooms uses
fan_out.py       calls into the graph made side by side from inside one Serve request, each with ids of its own
graph_links.py   the Renderer and Scheduler deployments over Serve handles: render, tokenize, stream one
                 EngineRequest, every replica's status
engine_reply.py  one EngineRequest's reply read from its stream: the first item (a refusal, or the reply's
                 start), then every chunk to the finish
"""
