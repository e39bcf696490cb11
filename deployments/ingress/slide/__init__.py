"""/v1/slide: living weights (docs/slide.md): learn facts into the served weights, read the graph, delete.

models.py validates the bodies, calls.py speaks to the engines (one lock, one trainer, versions staged on
every replica), asking.py asks questions greedily at a pocket version, locality.py holds the prompts no
fact may change, extraction.py has the served model find a text's facts, checks.py judges a staged
version, serving.py runs a learn or a delete as events, framing.py shapes them, routes.py is the routes.
"""
