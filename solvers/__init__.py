"""solvers: torch-free rematerialization / offload planners over DAGs."""
