"""Which Scheduler replica (model copy) a request goes to: prefix affinity with balance (runs in Ingress)."""
