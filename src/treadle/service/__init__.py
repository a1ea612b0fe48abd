"""Rollouts as a service: the HTTP API (`app`), jobs on the runtime (`jobs`), wire
schemas (`schemas`), metrics, and the parts built from a configuration (`state`)."""
