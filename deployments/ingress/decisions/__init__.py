"""POST /v1/decisions: SGLang's decision API (prompt format version 1), answered from next-token scores.

models.py validates the body, prompt.py words each question, serving.py renders and scores them,
framing.py turns the scores into answers and the reply, routes.py is the route.
"""
