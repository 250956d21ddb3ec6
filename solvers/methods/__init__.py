"""Layer 2: one formulation or algorithm per module (baselines, chain programs, exact models, bounds),
each ``solve_<name>(problem, time_limit) -> Solution``; `catalog` lists them for the registry.
Imports only `solvers.core` and other methods."""
