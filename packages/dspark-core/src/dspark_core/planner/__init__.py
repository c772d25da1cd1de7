"""The planner: which parts of a draft run fused, and why any part stays stock."""
