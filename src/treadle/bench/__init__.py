"""`treadle bench`: the benchmarks with a JSON report, in one place above what they measure.

`sim` (the scheduling policies on the simulator), `live` (the live runtime on
emulated engines against the simulator, side by side), `service` (the HTTP service
at scale against the simulator) and `sandbox` (sandbox backends). A report goes to
`out/` unless `--out` says where; the committed reports under `benchmarks/` are
written only when `--out` names them.
"""
