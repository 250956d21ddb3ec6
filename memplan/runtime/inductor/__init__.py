"""Stage 5, compiled: a program's segments cut into runs that Inductor compiles, each checked against its eager twin."""
