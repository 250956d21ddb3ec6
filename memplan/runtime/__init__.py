"""Stage 5: execute a solved plan: the generated program, and its Inductor-compiled runs."""
