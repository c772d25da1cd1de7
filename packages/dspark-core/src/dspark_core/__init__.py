"""dspark-core: the numeric spec of the DSpark draft (its stock eager layers as
an executable specification), the reference draft model and the planner.
Pure PyTorch; no GPU needed."""

__version__ = "0.1.0"
