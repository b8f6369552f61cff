"""Tiny random checkpoints in Hugging Face format, for tests, benchmarks and the demo.

``write_tiny_model`` writes ``config.json``, ``generation_config.json``,
``model.safetensors`` (HF tensor names) and a byte-level BPE tokenizer built
with the ``tokenizers`` library, so ``transformers`` and pat-engine load the
very same checkpoint. Nothing is downloaded.

Weights are drawn so that greedy decoding is diverse: default tiny random
models tend to emit one token forever, which hides position and KV bugs. A
large embedding scale, unit-variance projections and a sharp LM head make the
next token depend on the context.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS_WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two has look "
    "more day could go come did number sound no most people my over know water than call first who may down side "
    "been now find any new work part take get place made live where after back little only round man year came "
    "show every good me give our under name very through just form sentence great think say help low line differ "
    "turn cause much mean before move right boy old too same tell does set three want air well also play small end "
    "put home read hand port large spell add even land here must big high such follow act why ask men change went "
    "light kind off need house picture try us again animal point mother world near build self earth father reason "
    "proof lemma theorem answer step therefore compute sum product equal integer prime divide remainder"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "llama"  # "llama", "qwen2", "qwen3" or "qwen3_moe"
    vocab_size: int = 390  # deliberately not a multiple of 4: exercises vocab padding
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int | None = None
    max_position: int = 1024
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    llama3_rope_scaling: bool = False
    seed: int = 0
    # qwen3_moe: each sparse layer routes a token to experts_per_token of num_experts MLPs
    num_experts: int = 8
    experts_per_token: int = 2
    moe_intermediate_size: int = 64
    mlp_only_layers: tuple[int, ...] = ()  # these keep the dense MLP
    extra: dict = field(default_factory=dict)


_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM"}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
_QK_NORM = ("qwen3", "qwen3_moe")


def hf_config(spec: TinyModelSpec) -> dict:
    """The ``config.json`` a checkpoint of ``spec`` carries (``write_tiny_model``)."""
    if spec.arch not in _HF_CLASSES:
        raise ValueError(f"unknown tiny arch {spec.arch!r}; choose from {sorted(_HF_CLASSES)}")
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    rope: dict = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.llama3_rope_scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": spec.rope_theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,  # small, so scaling affects short tests
        }
    cfg = {
        "architectures": [_HF_CLASSES[spec.arch]],
        "model_type": _MODEL_TYPES[spec.arch],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope,
        "rope_theta": spec.rope_theta,
        "rope_scaling": rope if spec.llama3_rope_scaling else None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "attention_bias": spec.arch == "qwen2",
        "use_sliding_window": False,
        **spec.extra,
    }
    if spec.arch == "qwen3_moe":
        cfg.update(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                   moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=list(spec.mlp_only_layers), output_router_logits=False)
    return cfg


def _random_weights(spec: TinyModelSpec, cfg: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    h, inter, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    hd = cfg["head_dim"]
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def near_one(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h, std=1.0)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = near_one(h)
        w[p + "post_attention_layernorm.weight"] = near_one(h)
        w[p + "self_attn.q_proj.weight"] = normal(q, h, std=2.0 / h**0.5)  # sharp attention
        w[p + "self_attn.k_proj.weight"] = normal(kv, h, std=2.0 / h**0.5)
        w[p + "self_attn.v_proj.weight"] = normal(kv, h, std=1.0 / h**0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, q, std=1.0 / q**0.5)
        if spec.arch == "qwen3_moe" and i not in spec.mlp_only_layers:
            w[p + "mlp.gate.weight"] = normal(spec.num_experts, h, std=2.0 / h**0.5)  # tokens spread over experts
            for e in range(spec.num_experts):
                w.update(_mlp_weights(f"{p}mlp.experts.{e}.", h, spec.moe_intermediate_size, normal))
        else:
            w.update(_mlp_weights(p + "mlp.", h, inter, normal))
        if spec.arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal(q, std=0.1)
            w[p + "self_attn.k_proj.bias"] = normal(kv, std=0.1)
            w[p + "self_attn.v_proj.bias"] = normal(kv, std=0.1)
        if spec.arch in _QK_NORM:
            w[p + "self_attn.q_norm.weight"] = near_one(hd)
            w[p + "self_attn.k_norm.weight"] = near_one(hd)
    w["model.norm.weight"] = near_one(h)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = normal(v, h, std=3.0 / h**0.5)
    else:
        # Tied head: logits = E . h, and the residual stream carries the input embedding, so a large
        # E makes every token predict itself. A small E and stronger layer outputs break that loop.
        w["model.embed_tokens.weight"] *= 0.1
        for name in w:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w[name] *= 2.0
    # A tiny model rarely emits EOS by chance; keep its logit low so tests control lengths.
    lm = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
    lm[EOS_ID] *= 0.25
    return {k: t.contiguous() for k, t in w.items()}


def _mlp_weights(prefix: str, h: int, inter: int, normal) -> dict[str, torch.Tensor]:
    return {prefix + "gate_proj.weight": normal(inter, h, std=1.0 / h**0.5),
            prefix + "up_proj.weight": normal(inter, h, std=1.0 / h**0.5),
            prefix + "down_proj.weight": normal(h, inter, std=1.0 / inter**0.5)}


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = _CORPUS_WORDS
    corpus = [" ".join(words[(i * 7) % len(words) :] + words[: (i * 7) % len(words)]) for i in range(40)]
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )


def write_tiny_model(path: str | Path, spec: TinyModelSpec | None = None, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write a tiny random checkpoint to ``path`` (created if needed) and return it."""
    spec = spec or TinyModelSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(spec)
    tokenizer = _build_tokenizer(spec.vocab_size - 6)  # the last ids are "reserved", never decoded
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False})
    )
    weights = {k: t.to(dtype) for k, t in _random_weights(spec, cfg).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    (out / "pat_tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out
