"""dspark-vllm: the out-of-tree vLLM 0.33.0 plugin that runs the DSpark
draft's specialized decode inside vLLM.

- ``plugin``: the ``vllm.general_plugins`` entry point (registers the draft class);
- ``model``: the draft class, switched by ``additional_config["decode_backend"]``;
- ``deployment``: the deployment check (``unsupported``) and the all-reduce facts;
- ``options``: the ``additional_config`` keys DSpark reads, their near misses said once;
- ``adapter``: ``describe_vllm``, the model-neutral description of vLLM's draft;
- ``planning``: the plan with the vLLM-side refusals (``exact_kernels``:
  per architecture, the kernels checked against vLLM's stock on a GPU);
- ``runtime``: the specialized decode's lifecycle and per-call dispatch;
- ``plan``: ``python -m dspark_vllm.plan``, the plan of a draft checkpoint.

Importing this package imports nothing of vLLM.
"""

__version__ = "0.1.0"
