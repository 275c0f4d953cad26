"""Studies: the method comparison, its statistics and report, the allocation simulator's driver and sweeps."""
