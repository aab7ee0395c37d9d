"""Check the QUADS --spec and --quads-* flags against a Megatron-LM checkout's own argument handling.

    PYTHONPATH=/path/to/Megatron-LM python tools/check_megatron_lm_spec.py MEGATRON-LM-FLAGS...

Runs, on CPU and without training, what Megatron-LM (core_v0.16.1) does before it builds a GPT
model: its ``parse_args`` with :func:`add_quads_args` as ``extra_args_provider``, ``validate_args``
with the launcher's ``--spec`` default, ``core_transformer_config_from_args``, and its ``--spec``
loader (``import_module(args.spec)``) on the QUADS module. It then builds the model from that spec
and from Megatron-LM's stock MoE block spec and prints whether their checkpoint keys agree. Pass
``--transformer-impl local`` and the ``--no-*-fusion`` flags that need TE or apex where those are absent.
"""

from __future__ import annotations

import sys

from megatron_quads.megatron_lm.args import SPEC, add_quads_args


def main(argv: list[str]) -> int:
    """Parse ``argv`` as Megatron-LM does, load the QUADS spec through ``--spec``, compare checkpoint keys."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training import global_vars
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    from megatron_quads.trainer.cpu_compat import init_distributed_cpu
    from megatron_quads.trainer.megatron_fixes import fix_router_without_te

    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args(extra_args_provider=add_quads_args)
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer", "spec": list(SPEC)})
    args.padded_vocab_size = args.vocab_size or 128
    global_vars.set_args(args)
    config = core_transformer_config_from_args(args)
    init_distributed_cpu(world_size=1, rank=0)
    fix_router_without_te()
    spec = import_module(args.spec)

    def gpt(layer_spec) -> GPTModel:
        return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=args.padded_vocab_size,
                        max_sequence_length=args.max_position_embeddings,
                        position_embedding_type=args.position_embedding_type,
                        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)

    model = gpt(spec)
    stock = gpt(get_gpt_decoder_block_spec(config, use_transformer_engine=args.transformer_impl == "transformer_engine",
                                           normalization=args.normalization))
    fake = sorted({type(m).__name__ for m in model.modules() if "FakeQuant" in type(m).__name__})
    same = list(model.state_dict()) == list(stock.state_dict()) and set(model.sharded_state_dict()) == set(
        stock.sharded_state_dict())
    print(f"--spec {' '.join(args.spec)}: {type(spec).__name__}; quads={args.quads} scope={args.quads_scope} "
          f"layout={args.quads_block_layout} rac_ratio={args.quads_rac_ratio}")
    print(f"fake-quant modules: {', '.join(fake) or 'none'}")
    print(f"checkpoint keys equal to Megatron-LM's stock MoE spec: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
