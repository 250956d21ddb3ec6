"""What users call: ``memplan.optimize``, the optimized module, the ``torch.compile`` backend, budgets, distributed guards."""
