"""Layer 1, the base: plain data (`problem.Problem`, `schedule.Schedule`, `solution.Solution`), the alias
rule (`memory`), the one simulator (`schedule.simulate` / `validate`), and the scans every layer above
shares (`sequence`, `uses`, `method`). Imports nothing above it."""
