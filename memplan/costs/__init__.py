"""Stage 2: put bytes and seconds on every node of a captured graph (the device's cost table)."""
