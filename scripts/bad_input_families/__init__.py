"""The case families of ``scripts/bad_inputs.py``, by theme (``common`` holds
what they share). Importing the package sets the environment they run in
first: the property tests' module and vLLM's test draft on the path, and
vLLM's settings for a plan on a CPU machine."""

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The property tests' module (the entries and their words) and vLLM's test draft (_draft), by name.
sys.path[:0] = [str(ROOT / "packages" / "dspark-vllm" / "tests"), str(ROOT / "tests")]
# vLLM's settings for a plan on a CPU machine (python -m dspark_vllm.plan sets them too, but vLLM is imported
# here first): its CPU platform, the V2 model runner, no hub.
for _key, _value in (("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_USE_V2_MODEL_RUNNER", "1"), ("HF_HUB_OFFLINE", "1"),
                     ("TRANSFORMERS_OFFLINE", "1"), ("VLLM_LOGGING_LEVEL", "ERROR"),
                     ("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "dspark-vllm-tests-cache"))):
    os.environ.setdefault(_key, _value)
