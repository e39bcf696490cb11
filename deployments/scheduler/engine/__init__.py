"""The engine core of a Scheduler replica (no Ray): one model copy's requests, from arrival to last chunk.

`core.Engine` holds the parts below; its `run_once(inbox)` is the loop body every transport drives, and
`generate` runs that body offline. `requests.py` (`Requests`) is the one owner of a request's life: the
tables of requests and every change to them; the other parts decide and report. By job, in the order a
request meets them:

- `admission.py`: the checks (a `Refusal` value, before any work), the reply limit, the `Sequence`
  (`sequence.py`: one request's tokens, blocks and output state); `disk_states.py` restores its prompt
  from the node's disk store where that pays.
- `planner.py`: which prompt chunk or decode round runs next, which request takes a lane and which is
  preempted; over `kv_blocks.py` (the paged KV pool and its prefix cache) and `draft_rounds.py` /
  `drafts.py` (what each decode round verifies: MTP or n-gram drafts, cut to what pays).
- `stepping.py`: one step: plan, execute on the ranks, apply what it drew through `Requests`.
- `reply_writer.py`: each drawn token into the reply (`thinking.py`: a forced think close; `grammar.py`:
  the constraint and its mask; `text_output.py`: text and stop strings), and the reply's end, reported.
- `snapshots.py`: what the loop reports besides replies (info with the live rates, memory figures, the
  router's digest). `completion.py`: one reply folded whole, for `generate`.
- `disk_states.py`: states written to the disk store while idle, the imprint routes' answers
  (`disk_types.py`: the KV rows' reads and writes and the resume plan they use).
- `memory.py`: sizing the KV pool at startup.
"""
