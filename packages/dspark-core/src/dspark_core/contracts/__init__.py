"""The contracts between the planner and the kernel backends."""
