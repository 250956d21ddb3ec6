"""The optimizer's step inside the plan: learning what an update costs, its node names, and running updates."""
