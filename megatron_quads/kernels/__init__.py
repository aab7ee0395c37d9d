"""GPU kernels of the rollout side: W4A16 and W4A4 + RAC GEMMs (dense and grouped), MoE routing and
combine.

Each kernel is an optimisation of a PyTorch reference in :mod:`megatron_quads.rollout` (which
dispatches here on CUDA, :func:`megatron_quads.nvfp4.backend.use_kernels`) and is tested against it.
Modules of this package import only :mod:`megatron_quads.nvfp4`, torch and Triton; importing the
package itself needs no Triton.
"""
