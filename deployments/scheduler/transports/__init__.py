"""How a Scheduler replica drives its engine, in one of two ways, both thin around `Engine.run_once`.

- `hub.py`: the caller side both share (`StreamHub`): each request's mailbox on its caller's event loop,
  the engine's latest snapshots, calls awaiting their answers; `on_stepped` takes each turn's `Stepped`.
- `thread.py` (`EngineLoop`): the engine on a thread of this process (tests, benchmarks, tensor-parallel
  replicas); refusals are checked on the caller's thread.
- `process.py` (`EngineProcess`) and `child.py`: the engine in a child process (tensor-parallel size 1,
  by default), over a socket carrying the messages of deployments/messages/engine_process.py;
  `store_relay.py`: the child's calls on the node's prompt store, made by the replica.
"""
