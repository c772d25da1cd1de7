"""DSpark's exceptions.

``Unsupported`` is a refusal: a part of a draft that the fused kernels do not
reproduce. The planner catches exactly this type and keeps that part's stock
modules, reporting the message. Bad input raises ``ValueError`` or
``TypeError`` with a sentence; anything else is a bug and propagates.
"""


class Unsupported(ValueError):
    """A part the fused kernels do not reproduce: the planner keeps its stock modules and reports the message."""
