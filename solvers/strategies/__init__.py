"""Layer 4: strategies that combine methods and transforms within a time limit (hierarchical,
minimum-budget search, rematerialization, offload, the offload MILP run, auto). Imports only the
layers below; `solvers.registry` and `solvers.api` sit above."""
