"""Control plane without models: the real admission/batcher/planner/KV/weights actors on a virtual
clock, driven synchronously (replay, what-if simulation). Simulation-specific executors live here."""
