"""Checkpoint conversion between Hugging Face, Megatron dist checkpoints and the NVFP4-plus-residual format.

The config mapping (Qwen3-MoE ``config.json`` <-> :class:`PolicyModelConfig`) is
:mod:`megatron_quads.trainer.hf_config`.

- :mod:`.names`: Megatron dist-checkpoint tensors (layout-independent global tensors) <-> HF tensors;
- :mod:`.hf_source`: lazy, checked reading of a Hugging Face safetensors directory;
- :mod:`.megatron_source`: offline, layer-by-layer reading of a Megatron dist checkpoint;
- :mod:`.megatron_writer`: a dist checkpoint saved by Megatron ranks in a chosen TP/EP layout;
- :mod:`.finite`: a NaN or Inf in a source tensor stops the conversion, naming it;
- :mod:`.progress`: the converters' progress bar;
- :mod:`.commands`: ``hf-to-megatron``, ``megatron-to-hf`` and ``reshard``; :mod:`.to_quads`: ``to-quads``.

Output directories are complete or absent (:mod:`megatron_quads.atomic_io`) and carry a manifest of
sizes and sha256 checksums (:mod:`megatron_quads.manifest`).
"""
