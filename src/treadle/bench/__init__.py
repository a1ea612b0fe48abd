"""`treadle bench`: the benchmarks with a JSON report, in one place above what they measure.

`sim` (the scheduling policies on the simulator), `live` (the live runtime on
emulated engines against the simulator, side by side), `service` (the HTTP service
at scale against the simulator), `sandbox` (sandbox backends), `chaos` (the
service under seeded faults) and `gateway` (what the harness gateway adds to a
call over the engine's own, side by side). A report goes to
`out/` unless `--out` says where; the committed reports under `benchmarks/` are
written only when `--out` names them.
"""
