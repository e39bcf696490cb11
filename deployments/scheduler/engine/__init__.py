"""The engine core of a Scheduler replica: admission, planning, the step, each request's output (no Ray)."""
