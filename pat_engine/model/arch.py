"""Architecture description read from a Hugging Face ``config.json``.

One frozen ``ModelArch`` covers the Llama family we serve: Llama 2/3/3.1
(optionally with llama3 RoPE scaling), Qwen2/2.5 (bias on q/k/v), Qwen3
(RMSNorm on q and k per head) and Qwen3-MoE (Qwen3 whose MLPs are routed experts:
``MoESpec``). Anything else is refused with a clear error.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from pat_engine import env
from pat_engine.errors import LayoutError, ModelLoadError
from pat_engine.parallel.kv_plan import kv_bytes_per_token, kv_heads_per_rank
from pat_engine.parallel.layout import Layout, candidate_layouts

# HF ``architectures`` entry -> (attention bias on qkv, q/k RMSNorm).
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Qwen3MoeForCausalLM": (False, True),
}
MOE_ARCHITECTURES = frozenset({"Qwen3MoeForCausalLM"})
FUSED_MOE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # tl.dot's (pat_kernels/fused_moe.py)


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class MoESpec:
    """The routed experts of a Qwen3-MoE model: each token's ``experts_per_token`` best experts by the
    router's softmax (renormalised over the chosen when ``norm_topk_prob``) each run a SiLU-gated MLP of
    ``intermediate_size``; their outputs, weighted, replace the layer's MLP. Layers in ``dense_layers`` keep
    the dense MLP of ``ModelArch.intermediate_size`` (HF's ``mlp_only_layers`` and ``decoder_sparse_step``)."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_eps: float
    rope: RopeSpec
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoESpec | None = None  # routed experts (Qwen3-MoE); None: every layer's MLP is dense

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the routed experts (``moe``) rather than the dense MLP."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def routes_on_host(self, device_type: str, numerics: str, dtype: torch.dtype) -> bool:
        """Whether a forward reads its own routing on the host (which experts got tokens), which a CUDA
        graph cannot capture (``EngineConfig.graphs``): an MoE model's layers do, unless they run the fused
        Triton experts, which route on the device (``SparseMoE.fused``: fast numerics, a 16- or 32-bit float
        dtype, where ``PAT_FUSED_MOE`` serves the device). The invariant mode's experts keep their per-row
        reduction tree, on the host's routing."""
        fused = numerics == "fast" and dtype in FUSED_MOE_DTYPES and env.fused_moe(device_type)
        return self.moe is not None and not fused

    @property
    def activation_width(self) -> int:
        """The widest gate/up activation a token makes in one layer (all TP ranks together): the dense
        MLP's, or its experts' ``experts_per_token`` MLPs' (memory planning)."""
        dense = self.intermediate_size if self.moe is None or self.moe.dense_layers else 0
        sparse = self.moe.experts_per_token * self.moe.intermediate_size if self.moe else 0
        return max(dense, sparse)

    def fingerprint(self) -> str:
        """Stable short hash identifying the model shape (used by profile tables)."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def layout(self, world: int, tp: int) -> Layout:
        """The (tp, world / tp) layout, or ``LayoutError`` naming why this model or world cannot use it.

        The one home of "is this TP degree valid": the world rules live in ``Layout.for_world``,
        the model's here.
        """
        layout = Layout.for_world(world, tp)
        if self.num_heads % tp:
            raise LayoutError(f"tp={tp} does not divide num_attention_heads={self.num_heads}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise LayoutError(f"tp={tp} and num_key_value_heads={self.num_kv_heads}: one must divide the other")
        if (self.moe is None or self.moe.dense_layers) and self.intermediate_size % tp:  # a dense MLP is built
            raise LayoutError(f"tp={tp} does not divide intermediate_size={self.intermediate_size}")
        if self.moe is not None and self.moe.intermediate_size % tp:
            raise LayoutError(f"tp={tp} does not divide moe_intermediate_size={self.moe.intermediate_size}")
        return layout

    def valid_layouts(self, world: int) -> list[Layout]:
        """Every layout of ``world`` ranks this model can be sharded in, smallest TP first."""
        out = []
        for candidate in candidate_layouts(world):
            try:
                out.append(self.layout(world, candidate.tp))
            except LayoutError:
                pass
        return out

    def reduction_width(self, max_tp: int) -> int:
        """The invariant numerics mode's row-parallel chunk count (docs/numerics.md): the largest TP up to
        the declared ``max_tp`` (a power of two) this model can be sharded in. Every TP it allows up to
        ``max_tp`` divides it (a smaller power of two), so deployments of any size up to ``max_tp`` ranks
        and the trainer cut the same chunks."""
        return self.valid_layouts(max_tp)[-1].tp

    def kv_heads_per_rank(self, tp: int) -> int:
        return kv_heads_per_rank(self.num_kv_heads, tp)

    def kv_bytes_per_token(self, tp: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype.itemsize, tp)


def _rope_from_config(cfg: dict) -> RopeSpec:
    # transformers >= 5 writes "rope_parameters"; older checkpoints "rope_theta" + "rope_scaling".
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "llama3":
        return RopeSpec(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ModelLoadError(f"unsupported RoPE type {kind!r} (supported: default, llama3)")


_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings", "num_key_value_heads", "head_dim")


def _check_sizes(cfg: dict) -> None:
    """Every size the model is built from must be a positive integer (0 would build an empty model)."""
    for key in _POSITIVE:
        value = cfg.get(key)
        if value is None and key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            continue  # optional: derived or defaulted
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"config.json: {key} must be a positive integer, got {value!r}")


_MOE_POSITIVE = {"moe_intermediate_size": None, "num_experts_per_tok": None, "decoder_sparse_step": 1}  # defaults


def _moe_from_config(cfg: dict, num_layers: int) -> MoESpec:
    """Qwen3-MoE's expert settings (transformers writes ``num_experts``, or ``num_local_experts`` since v5)."""
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    for key, value in (("num_experts", num_experts), *((k, cfg.get(k, d)) for k, d in _MOE_POSITIVE.items())):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"config.json: {key} must be a positive integer, got {value!r}")
    top_k = int(cfg["num_experts_per_tok"])
    if top_k > num_experts:
        raise ModelLoadError(f"config.json: num_experts_per_tok={top_k} exceeds num_experts={num_experts}")
    step = int(cfg.get("decoder_sparse_step", 1))
    only_dense = cfg.get("mlp_only_layers") or []
    if not isinstance(only_dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only_dense):
        raise ModelLoadError(f"config.json: mlp_only_layers must be a list of layer indices, got {only_dense!r}")
    dense = tuple(i for i in range(num_layers) if i in only_dense or (i + 1) % step)  # HF's rule, per layer
    return MoESpec(num_experts=num_experts, experts_per_token=top_k,
                   intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)


def arch_from_hf_config(cfg: dict) -> ModelArch:
    """Build a ``ModelArch`` from a parsed ``config.json`` dictionary."""
    names = cfg.get("architectures") or []
    if not names:
        raise ModelLoadError("config.json has no 'architectures' entry")
    name = names[0]
    if name not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unknown architecture {name!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    default_bias, qk_norm = SUPPORTED_ARCHITECTURES[name]
    _check_sizes(cfg)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
    return ModelArch(
        architecture=name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_config(cfg),
        qkv_bias=bool(cfg.get("attention_bias", default_bias)),
        qk_norm=qk_norm,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
        moe=_moe_from_config(cfg, int(cfg["num_hidden_layers"])) if name in MOE_ARCHITECTURES else None,
    )


def load_model_arch(model_path: str | Path) -> ModelArch:
    path = Path(model_path)
    config_file = path / "config.json"
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {str(path)!r}")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
    arch = arch_from_hf_config(cfg)
    gen_file = path / "generation_config.json"
    if not arch.eos_token_ids and gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if eos is not None:
            ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
            arch = replace(arch, eos_token_ids=ids)
    return arch
