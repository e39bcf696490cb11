"""/v1/slide: living weights (docs/slide.md): learn facts into the served weights, read the graph, delete.

Only HTTP lives here; the workflows are the Slide room's (deployments/slide/). models.py validates the
bodies, serving.py asks the room for a change (its refusal as the route's error, or its events), the graph
or a clear, framing.py shapes the events and the graph, routes.py is the routes (501 without --slide).
"""
