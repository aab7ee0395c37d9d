"""The module Megatron-LM's ``--spec`` names: ``--spec megatron_quads.megatron_lm.layer_spec quads_layer_spec``.

Megatron-LM (core_v0.16.1, ``gpt_builders.py``) imports this module inside its model builder, after
it parsed and validated its arguments, and uses the attribute ``--spec`` names as the layer spec
itself (``megatron.core.transformer.spec_utils.import_module`` returns it; it is not called). So
importing this module builds the spec, from ``megatron.training.get_args()``; importing it outside a
Megatron-LM job fails with :class:`~megatron_quads.megatron_lm.spec.MegatronLMUnavailable`.
"""

from __future__ import annotations

try:
    from megatron_quads.megatron_lm.spec import quads_spec_from_args
except ImportError as err:
    # Megatron-LM's loader logs an ImportError and carries on with no spec; make the cause the error
    raise RuntimeError(f"megatron_quads could not load its QUADS spec builder: {err}") from err

quads_layer_spec = quads_spec_from_args()
"""The QUADS transformer-layer spec of this Megatron-LM job (see :func:`quads_spec_from_args`)."""
