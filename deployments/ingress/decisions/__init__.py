"""POST /v1/decisions: SGLang's decision API (prompt format version 1), answered from next-token scores.

models.py validates the body, prompt.py words each question, route.py renders, scores and frames them.
"""
