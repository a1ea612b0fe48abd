"""The built-in task suites: math, code, swe, search, stem (one module each)."""
