"""QUADS in Megatron-LM's own training scripts (pinned: Megatron-LM core_v0.16.1).

- :mod:`.layer_spec`: the module ``--spec`` names; importing it builds the QUADS layer spec from
  Megatron-LM's parsed arguments (``--spec megatron_quads.megatron_lm.layer_spec quads_layer_spec``);
- :mod:`.args`: the ``--quads-*`` flags (:func:`~.args.add_quads_args`, an ``extra_args_provider``);
- :mod:`.spec`: :func:`~.spec.quads_spec_from_args`, the spec for a given argument namespace;
- :mod:`.pretrain_gpt`: ``python -m megatron_quads.megatron_lm.pretrain_gpt``, Megatron-LM's
  ``pretrain_gpt.py`` with the ``--quads-*`` flags added;
- :mod:`.checkpoint`: the architecture and the QUADS flags a Megatron-LM checkpoint recorded, for
  ``megatron-quads convert``.

Nothing here imports Megatron-LM's training package at module level: it is not on PyPI, and only
the code that runs inside a Megatron-LM process needs it.
"""
