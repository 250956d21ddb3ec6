"""The pipeline written once: capture, passes, costs, lowering, solve and build, with its typed options and saved plans."""
