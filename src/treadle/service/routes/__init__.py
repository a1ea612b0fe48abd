"""The API's routes, one router per resource: jobs, rollouts, engines, weights, and the
service itself (health, metrics, schema). `treadle.service.app` puts them together."""
