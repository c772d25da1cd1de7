"""The vLLM tests' process settings, set before anything imports vLLM (they
import nothing of it here: sessions without vLLM skip every test module).

- ``VLLM_TARGET_DEVICE=cpu``: vLLM's CpuPlatform (the default, unspecified
  platform fails in the Attention constructor: "Invalid attention backend
  for None");
- ``VLLM_USE_V2_MODEL_RUNNER=1``: without Triton vLLM falls back to Model
  Runner V1, which rejects DSpark speculative decoding;
- offline hub, WARNING logs, and vLLM's model-info cache in a temporary
  folder that outlives the session (the registry inspects the plugin's lazy
  class in a subprocess once, ~30 s on two cores, then reads the cache).
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "dspark-vllm-tests-cache"))
