"""The GPU check's random Llama checkpoint: written once per workdir, layer by layer, and read back by
tensor name (the weight-sync part hands the same tensors to the engine)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import torch

from pat_engine.tiny_model import BOS_ID, EOS_ID, PAD_ID, TinyModelSpec, hf_config


def write_checkpoint(path: str | Path, spec: TinyModelSpec, dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cpu") -> Path:
    """A random Llama checkpoint in Hugging Face format, one safetensors file per layer, reused when
    ``path`` already holds this spec in this dtype.

    ``pat_engine.tiny_model.write_tiny_model`` draws every tensor in float32 on one CPU thread and
    serialises the whole dict at once: for the 8B shape that is ~32 GB of float32 + 16 GB cast + a
    16 GB serialisation copy. Here each layer is drawn on ``device`` in ``dtype`` and written on its
    own (peak host memory: the LM head, 1 GB). No tokenizer: prompts are token ids."""
    from safetensors.torch import save_file

    out = Path(path)
    stamp = json.loads(json.dumps({"spec": asdict(spec), "dtype": str(dtype)}))  # as the file reads back (tuples: lists)
    done = out / "gpu_check_checkpoint.json"
    if done.is_file() and json.loads(done.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)  # a write cut short (a part's timeout) must not pass for a finished one
    for old in out.glob("*.safetensors"):
        old.unlink()
    cfg = hf_config(spec)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}))
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(spec.seed)
    h, inter, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    hd = cfg["head_dim"]
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=g, device=dev, dtype=torch.float32 if dev.type == "cpu" else dtype)
        return t.mul_(std).add_(mean).to(dtype).cpu().contiguous()

    def save(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(out / f"{name}.safetensors"), metadata={"format": "pt"})

    save("model-00-embed", {"model.embed_tokens.weight": normal(v, h, std=1.0)})
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        save(f"model-{i + 1:02d}-layer", {
            p + "input_layernorm.weight": normal(h, std=0.1, mean=1.0),
            p + "post_attention_layernorm.weight": normal(h, std=0.1, mean=1.0),
            p + "self_attn.q_proj.weight": normal(q, h, std=h**-0.5),
            p + "self_attn.k_proj.weight": normal(kv, h, std=h**-0.5),
            p + "self_attn.v_proj.weight": normal(kv, h, std=h**-0.5),
            p + "self_attn.o_proj.weight": normal(h, q, std=q**-0.5),
            p + "mlp.gate_proj.weight": normal(inter, h, std=h**-0.5),
            p + "mlp.up_proj.weight": normal(inter, h, std=h**-0.5),
            p + "mlp.down_proj.weight": normal(h, inter, std=inter**-0.5),
        })
    head = {"model.norm.weight": normal(h, std=0.1, mean=1.0)}
    if not spec.tie_word_embeddings:
        head["lm_head.weight"] = normal(v, h, std=h**-0.5)
    save(f"model-{spec.num_layers + 1:02d}-head", head)
    (out / "pat_tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    done.write_text(json.dumps(stamp))
    return out


def checkpoint_tensors(path: str | Path, limit_bytes: int | None = None) -> list[tuple[str, str]]:
    """(file, tensor name) in file order, up to ``limit_bytes`` of tensors (all when None)."""
    from safetensors import safe_open

    out, total = [], 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if limit_bytes is not None and total >= limit_bytes:
                    return out
                sl = f.get_slice(name)
                total += math.prod(sl.get_shape()) * 2  # bf16 here; only a budget
                out.append((str(file), name))
    return out


def load_tensors(pairs: list[tuple[str, str]], device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    out = []
    by_file: dict[str, list[str]] = {}
    for file, name in pairs:
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                out.append((name, f.get_tensor(name).to(device)))
    return out
