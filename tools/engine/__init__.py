"""The engine's parts timed alone (allocator, scheduler, sampler, routing hook, adjusters) and whole runs: step
profiles, memory peaks, queue simulation, policy sweeps in one process, shifted streams."""
