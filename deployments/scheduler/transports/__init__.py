"""How a Scheduler replica drives its engine: on a thread of its own process, or in a child process."""
