"""The scheduler tick: places queued jobs on peers, expires deadlines, recovers lost work."""
