"""How one graph node runs eagerly: ATen kernels and memplan's own ops, and the moves of tensors between device and host."""
