"""memplan: plan a training step's memory under a byte budget (torch side)."""
