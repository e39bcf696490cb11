"""The Slide room: living weights' workflows (`--slide`, docs/slide.md), a deployment Ingress's /v1/slide
routes call.

deployment.py  the Ray Serve deployment (one replica, only with --slide), over handles to the Renderer and
               the Scheduler; a change is one streaming call
room.py        SlideRoom: a change's refusals first, then the lock on every Scheduler replica, its events,
               and the lock released however it ends; the graph; a graph clear
links.py       what the room reaches: the Renderer and the Scheduler replicas (Serve handles, or in-process
               through serve_app/local_backend.py)
context.py     what every step shares (links, settings, the window), and how the room refuses
engine.py      the typed slide calls to every Scheduler replica: the lock, the trainer, versions on all
changes.py     a change holding the lock, and how a failure ends it
learning.py    a learn, fact by fact: add, train, stage, judge, commit or drop
forgetting.py  a delete: zero, commit, check every other fact, read the graph back
extraction.py  a text's facts, written by the served model under a JSON schema
asking.py      a question asked greedily with thinking off, at a pocket version
checks.py      questions as training examples, the quiet set, and the judgement of a staged version
locality.py    the locality prompts no fact may change
"""
