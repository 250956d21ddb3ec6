"""Stage 1: trace a model's forward and backward into one ATen-level ``torch.fx`` graph on fake tensors."""
