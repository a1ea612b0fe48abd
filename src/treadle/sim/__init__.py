"""The discrete-event cluster simulator that drives the scheduling core."""
