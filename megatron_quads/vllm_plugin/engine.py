"""The vLLM rollout engine: :class:`~megatron_quads.rollout.engine.RolloutEngine` on ``vllm.LLM``.

The engine is built from a checkpoint directory in the project's format (NVFP4-plus-residual for
w4a16 / w4a4 / quads, served by the QUADS plugin; a Hugging Face safetensors directory for bf16,
served by vLLM itself). Given no directory, the first :meth:`VllmRolloutEngine.load_weights` writes
one (a temporary directory, removed by :meth:`close`) and builds the engine from it; every later
call updates the weights in place through vLLM's layer-wise reload, without restarting the engine,
and resets the prefix cache. In quads mode :meth:`calibrate` chooses the RAC channels inside the
engine from its experts' inputs on calibration prompts (the built-in engine's rule). The precision
reaches the plugin through the checkpoint directory the engine writes (its ``quads.precision``).

Log-probs are vLLM's ``processed_logprobs``: ``log_softmax(logits / temperature)`` of each sampled
token (temperature 1 when greedy), the quantity the trainer recomputes. vLLM's processed log-probs
are taken after top-p truncation, so the engine refuses ``top_p < 1`` rather than return another
quantity. By default the engine core runs in this process (``multiprocess=False``: start-up in
seconds, updates passed as tensors by reference); with ``multiprocess=True`` (vLLM's default
process layout) or several GPUs per engine, updates reach the workers as one safetensors file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_quads.precision import Precision
from megatron_quads.rollout.checkpoint_format import MODEL_CONFIG_FILE, RESIDUAL_LEAVES, write_checkpoint
from megatron_quads.rollout.engine import Generation, SamplingParams
from megatron_quads.rollout.model_weights import QuantizedModelWeights
from megatron_quads.rollout.quantize_model import quantize_hf_weights
from megatron_quads.rollout.quantized_checkpoint import save_quantized_weights
from megatron_quads.rollout.rac import ChannelStatistic
from megatron_quads.rollout.scopes import routed_expert_scope
from megatron_quads.vllm_plugin.versions import vllm_cudagraph_mode

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
WORKER_EXTENSION = "megatron_quads.vllm_plugin.worker_extension.QuadsWorkerExtension"


@dataclass(frozen=True)
class VllmOptions:
    """How the vLLM engine is started (``rollout.vllm`` in the run config)."""

    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    cpu_kv_cache_gb: int = 1  # CPU: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float = 0.5  # GPU: the fraction of the GPU vLLM may take
    gpu_kv_cache_gb: float | None = None  # GPU: the KV cache's size (kv_cache_memory_bytes); None: vLLM profiles
    enforce_eager: bool = True  # False: CUDA graphs on GPU
    cudagraph_mode: str = "FULL_DECODE_ONLY"  # vLLM's CUDAGraphMode name, when not enforce_eager
    compilation_mode: int = 0  # vLLM's torch.compile mode when not enforce_eager (0: none)
    multiprocess: bool = False  # True: the engine core in its own process (vLLM's default)
    tensor_parallel_size: int = 1  # GPUs per engine (attention tensor-parallel)
    enable_expert_parallel: bool = False  # routed experts expert-parallel over those GPUs (the QUADS MoE method's sharding)
    enable_sleep_mode: bool = False  # GPU, colocated: sleep() frees weights and KV cache for the trainer
    cpu_threads_bind: str = "nobind"  # CPU: VLLM_CPU_OMP_THREADS_BIND ("auto" pins OpenMP threads to cores)
    routed_experts: bool = False  # generate can return each token's experts (router capture; prefix caching off)


def _dense_state_dict(weights: QuantizedModelWeights | Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named high-precision tensors (NVFP4 linears dequantized) for a bf16 engine."""
    if not isinstance(weights, QuantizedModelWeights):
        return {name: t.to(dtype) for name, t in weights.items()}
    dense = {name: t.to(dtype) for name, t in weights.unquantized.items()}
    dense.update({f"{module}.weight": lin.dequantized_weight(dtype) for module, lin in weights.quantized.items()})
    return dense


class VllmRolloutEngine:
    """A rollout engine on vLLM (see module docstring).

    ``hf_config``: the model's Hugging Face config (a dict, as config.json holds it); ``precision``:
    the run's precision (its rollout kind and RAC ratio are what the engine serves); ``checkpoint``: a
    directory to build the engine from now (its recorded precision is the one served; else the first
    :meth:`load_weights` writes one that records ``precision``)."""

    def __init__(self, hf_config: Mapping[str, Any], precision: Precision = Precision("quads", 0.25),
                 dtype: torch.dtype = torch.bfloat16, options: VllmOptions = VllmOptions(), seed: int = 0,
                 checkpoint: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(precision, Precision):
            raise TypeError(f"precision must be a megatron_quads.precision.Precision, got {precision!r}")
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"the vLLM engine runs in {sorted(_DTYPE_NAMES.values())}, not {dtype}")
        self.hf_config = dict(hf_config)
        self.precision = precision
        self.dtype = dtype
        self.options = options
        self.seed = seed
        self.weight_version = -1
        self.llm = None
        self._owned_dir: Path | None = None
        if checkpoint is not None:
            self._start(Path(checkpoint))

    # ------------------------------------------------------------------ lifecycle
    @property
    def ratio(self) -> float:
        """The RAC ratio (0 unless quads)."""
        return self.precision.ratio

    def _start(self, directory: Path) -> None:
        """Build ``vllm.LLM`` from a checkpoint directory (the plugin reads the precision from its
        ``quads`` block)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.options.multiprocess else "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.options.cpu_kv_cache_gb))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", self.options.cpu_threads_bind)
        from vllm import LLM

        if self.options.routed_experts and not (self.in_process and self.options.enforce_eager):
            raise ValueError("routed experts from vLLM are captured in the routers' hooks: they need the in-process "
                             "engine (rollout.vllm.multiprocess=false, tensor_parallel_size=1) and enforce_eager=true")
        max_len = self.options.max_model_len or int(self.hf_config.get("max_position_embeddings", 2048))
        kv_cache = self._kv_cache_size()
        graphs = {} if self.options.enforce_eager else {"compilation_config": {
            "mode": self.options.compilation_mode, "cudagraph_mode": self.options.cudagraph_mode}}
        self.llm = LLM(
            model=str(directory), skip_tokenizer_init=True, dtype=_DTYPE_NAMES[self.dtype], max_model_len=max_len,
            max_num_seqs=self.options.max_num_seqs, enforce_eager=self.options.enforce_eager,
            gpu_memory_utilization=self.options.gpu_memory_utilization,
            enable_sleep_mode=self.options.enable_sleep_mode, logprobs_mode="processed_logprobs", seed=self.seed,
            worker_extension_cls=WORKER_EXTENSION, tensor_parallel_size=self.options.tensor_parallel_size,
            enable_expert_parallel=self.options.enable_expert_parallel,
            # a cached prefix is not computed, so its tokens' routing could not be captured
            enable_prefix_caching=not self.options.routed_experts, **graphs, **kv_cache,
            **self._precision_override(directory),
        )
        self.weight_version = self._version_of(directory)

    def _kv_cache_size(self) -> dict[str, int]:
        """``kv_cache_memory_bytes`` when ``gpu_kv_cache_gb`` is set: vLLM then skips profiling the
        GPU's free memory, which fails when another engine on the same GPU sleeps or wakes meanwhile
        (several runs sharing a GPU). A CPU engine's KV cache is ``cpu_kv_cache_gb``."""
        gb = self.options.gpu_kv_cache_gb
        if gb is None:
            return {}
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            raise ValueError(f"rollout.vllm.gpu_kv_cache_gb={gb} sizes a GPU engine's KV cache; this engine runs on "
                             f"CPU, whose KV cache rollout.vllm.cpu_kv_cache_gb sizes: unset gpu_kv_cache_gb")
        return {"kv_cache_memory_bytes": int(gb * 2**30)}

    def _precision_override(self, directory: Path) -> dict[str, Any]:
        """``LLM`` arguments that make the plugin serve this engine's precision from a QUADS checkpoint
        that records another one, or none (a checkpoint given to the constructor): its ``quads`` block
        with the engine's ``precision``, as vLLM's ``hf_overrides``; nothing where they agree."""
        if not self.precision.quantized_rollout:
            return {}
        quant = json.loads((directory / "config.json").read_text()).get("quantization_config")
        quads = quant.get("quads") if isinstance(quant, dict) else None
        wanted = str(self.precision.rollout())
        if not isinstance(quads, dict) or quads.get("precision") == wanted:
            return {}
        return {"hf_overrides": {"quantization_config": {**quant, "quads": {**quads, "precision": wanted}}}}

    def cudagraph_mode(self) -> str:
        """The CUDA-graph mode vLLM runs with after start-up (``NONE`` when eager): vLLM may lower the
        mode it was asked for where the attention backend or the platform cannot capture it."""
        return vllm_cudagraph_mode(self.llm)

    def _version_of(self, directory: Path) -> int:
        quads = json.loads((directory / "config.json").read_text()).get("quantization_config", {}).get("quads", {})
        return int(quads.get("weight_version", 0))

    def close(self) -> None:
        """Shut the engine down and remove the directory it wrote."""
        if self.llm is not None:
            engine = getattr(self.llm, "llm_engine", None)
            if engine is not None and hasattr(engine, "engine_core"):
                engine.engine_core.shutdown()
            self.llm = None
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None

    def sleep(self) -> None:
        """Free the weights and KV cache on the GPU (vLLM's sleep mode, level 1; needs enable_sleep_mode)."""
        if self.llm is not None and self.options.enable_sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        """Undo :meth:`sleep`."""
        if self.llm is not None and self.options.enable_sleep_mode:
            self.llm.wake_up()

    # ------------------------------------------------------------------ weights
    def _served(self, weights: QuantizedModelWeights | Mapping[str, torch.Tensor], version: int):
        """What the engine takes for its precision: BF16 tensors (bf16) or QuantizedModelWeights."""
        if not self.precision.quantized_rollout:
            return _dense_state_dict(weights, self.dtype)
        if isinstance(weights, QuantizedModelWeights):
            return weights
        return quantize_hf_weights(((n, t.float()) for n, t in weights.items()), routed_expert_scope(),
                                   ratio=self.ratio, weight_version=version, unquantized_dtype=self.dtype)

    def load_weights(self, weights: QuantizedModelWeights | Mapping[str, torch.Tensor], version: int) -> None:
        """Serve new weights (BF16 tensors by HF name, or QuantizedModelWeights): the first call
        writes a checkpoint and starts the engine, later ones update the running engine in place
        (RAC channel sets included) and reset its prefix cache."""
        served = self._served(weights, version)
        if self.llm is None:
            self._owned_dir = Path(tempfile.mkdtemp(prefix="quads-vllm-"))
            directory = self._owned_dir / "checkpoint"
            if isinstance(served, QuantizedModelWeights):
                save_quantized_weights(served, directory, model_config=self.hf_config, precision=self.precision.rollout())
            else:
                write_checkpoint(directory, served, {MODEL_CONFIG_FILE: self.hf_config})
            self._start(directory)
        else:
            state = served.state_dict() if isinstance(served, QuantizedModelWeights) else served
            if not self.precision.uses_rac:  # the layers read and drop them: each would cost a loader call
                state = {name: t for name, t in state.items() if name.rpartition(".")[2] not in RESIDUAL_LEAVES}
            if self.in_process:
                self.llm.collective_rpc("quads_update_weights", args=(list(state.items()),))
            else:  # vLLM's RPC cannot carry tensors between processes: hand the workers a file
                self._update_through_file(state)
            self.llm.reset_prefix_cache()
        self.weight_version = version

    @property
    def in_process(self) -> bool:
        """Whether vLLM's workers run in this process (then RPC arguments carry tensors by reference)."""
        return not self.options.multiprocess and self.options.tensor_parallel_size == 1

    def _update_through_file(self, state: Mapping[str, torch.Tensor]) -> None:
        """An in-place update for workers in other processes: one safetensors file they read."""
        from safetensors.torch import save_file

        from megatron_quads.rollout.checkpoint_format import owned_cpu_tensors

        with tempfile.TemporaryDirectory(prefix="quads-vllm-update-") as directory:
            path = Path(directory) / "update.safetensors"
            save_file(owned_cpu_tensors(state), path)  # decoded experts view shared stacks
            self.llm.collective_rpc("quads_update_weights_from_file", args=(str(path),))

    def parameter_storage(self) -> dict[str, tuple[int, int]]:
        """``{parameter: (data_ptr, nbytes)}`` of the served model (in-process engines)."""
        return self.llm.collective_rpc("quads_parameter_storage")[0]

    def calibrate(self, prompts: Sequence[Sequence[int]], statistic: ChannelStatistic = ChannelStatistic.OUTPUT_ERROR) -> int:
        """Choose RAC channels (quads) from the experts' inputs on ``prompts``: one prefill of every
        prompt under W4A16 records them, then each layer selects and writes its channels and ``W_S``;
        returns the routed tokens seen."""
        if not self.precision.uses_rac:
            raise ValueError(f"RAC calibration is for the quads precision; this engine serves {self.precision}")
        if self.llm is None:
            raise RuntimeError("no weights loaded: call load_weights first")
        self._check_prompts(prompts)
        from vllm import SamplingParams as VllmSamplingParams

        self.llm.reset_prefix_cache()  # every prompt token goes through the experts
        self.llm.collective_rpc("quads_begin_calibration")
        try:
            with torch.profiler.record_function("quads/calibrate_prefill"):
                self.llm.generate(self._prompts(prompts), VllmSamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        except BaseException:  # vLLM's own error is the one raised: the layers stop recording, choosing nothing
            self._abandon_calibration()
            raise
        with torch.profiler.record_function("quads/calibrate_choose"):
            tokens = self.llm.collective_rpc("quads_finish_calibration", args=(statistic.value,))[0]
        self.llm.reset_prefix_cache()
        return tokens

    def residual_channels(self) -> dict[str, torch.Tensor]:
        """The RAC channel set (CPU int32) of every routed expert linear, by checkpoint module name
        (every vLLM worker's experts under expert parallelism)."""
        if not self.precision.uses_rac:
            raise ValueError(f"RAC channels are held in the quads precision; this engine serves {self.precision}")
        if self.llm is None:
            raise RuntimeError("no weights loaded: call load_weights first")
        sets: dict[str, torch.Tensor] = {}
        for part in self.llm.collective_rpc("quads_residual_channels", args=(not self.in_process,)):
            sets.update({name: torch.as_tensor(channels, dtype=torch.int32) for name, channels in part.items()})
        return sets

    def _abandon_calibration(self) -> None:
        """After a failed calibration prefill: every layer stops recording and keeps its channels. A
        failure here is only logged, so the prefill's own error is the one the caller sees."""
        try:
            self.llm.collective_rpc("quads_abandon_calibration")
        except Exception:
            logging.getLogger(__name__).warning("the QUADS layers could not stop recording after a failed "
                                                "calibration prefill", exc_info=True)

    # ------------------------------------------------------------------ generation
    @staticmethod
    def _check_prompts(prompts: Sequence[Sequence[int]]) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompt")

    @staticmethod
    def _prompts(prompts: Sequence[Sequence[int]]) -> list:
        from vllm import TokensPrompt

        return [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """Continue every prompt (see :class:`Generation` for the log-prob convention). ``params.seed``
        seeds the sampler's generators before the call (``quads_seed_sampler``; the requests carry no
        seeds of their own, which would make vLLM sample each sequence separately at every step), so
        the same prompts in the same order with the same seed give the same tokens."""
        self._check_prompts(prompts)
        if params.return_routed_experts and not self.options.routed_experts:
            raise ValueError("this vLLM engine was started without routed experts: build it with "
                             "VllmOptions(routed_experts=True) (the controller does under rollout.router_replay=r3)")
        if self.llm is None:
            raise RuntimeError("no weights loaded: call load_weights first")
        if params.top_p < 1.0:
            raise ValueError("the vLLM engine returns log-probs after top-p truncation, which the trainer does not "
                             "recompute: use top_p=1 (rollout.top_p) with rollout.engine=vllm")
        from vllm import SamplingParams as VllmSamplingParams

        requests = [VllmSamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature,
                                       stop_token_ids=list(params.stop_token_ids), logprobs=0)
                    for _ in prompts]
        self.llm.collective_rpc("quads_seed_sampler", args=(params.seed,))
        if params.return_routed_experts:
            self.llm.collective_rpc("quads_start_routing_capture")
        try:
            outputs = self.llm.generate(self._prompts(prompts), requests, use_tqdm=False)
        finally:
            routing = _by_external_id(self.llm.collective_rpc("quads_take_routing")[0]) if params.return_routed_experts else None
        results = []
        for prompt, output in zip(prompts, outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [float(step[token].logprob) for token, step in zip(tokens, completion.logprobs)]
            result = Generation(prompt_ids=list(prompt), token_ids=tokens, logprobs=logprobs,
                                finish_reason="stop" if completion.finish_reason == "stop" else "length")
            if routing is not None:
                result.routed_experts = _fed_rows(routing, output.request_id, len(prompt) + len(tokens) - 1)
            results.append(result)
        return results


def _by_external_id(routing: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Captured routing keyed by the request ids outputs carry: vLLM's workers see
    ``f"{request_id}-{8 random characters}"`` (unless request-id randomisation is off)."""
    out: dict[str, torch.Tensor] = {}
    for internal, rows in routing.items():
        external = internal.rsplit("-", 1)[0] if "-" in internal else internal
        if external in out:
            raise RuntimeError(f"two captured vLLM requests map to request id {external!r}")
        out[external] = rows
    return out


def _fed_rows(routing: Mapping[str, torch.Tensor], request_id: str, fed: int) -> torch.Tensor:
    """A request's captured routing cut to its ``fed`` positions (rows past them, had vLLM computed
    any, belong to no token of the response)."""
    rows = routing.get(request_id)
    if rows is None or rows.shape[0] < fed:
        got = 0 if rows is None else rows.shape[0]
        raise RuntimeError(f"vLLM request {request_id}: routing captured for {got} positions, {fed} needed")
    return rows[:fed].clone()
