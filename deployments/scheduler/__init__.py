"""The Scheduler room: one model copy per replica: its engine (engine/), how the replica drives it
(transports/) and living weights' side of it (slide/)."""
