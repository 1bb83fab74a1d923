"""The executor: work units and leases, collective launch, stage processes, the round loop, gc, status."""
