"""The elementwise gates: ``o_gate`` (``OGate``: the o-norm and sigmoid gate)
and ``mlp_activation`` (``MlpActivation``: the gated SiLU); ``elementwise``
holds their shared head."""
