"""Stage 3: lower a captured graph to a solver ``Problem``, analyse it, and the saved-plan format."""
