"""A framework's reward function, the way that framework passes and calls it, as a pat reward
(``pat_engine.rollout.reward_fns``: ``fn(RewardInput) -> number | {"reward": ..., ...}``) for ``rollout_step``.

- **veRL** (0.9): ``compute_score(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)``,
  named by ``reward.custom_reward_function`` (``{"path", "name", "reward_kwargs"}``, loaded with veRL's
  own ``load_extern_object``; no path: veRL's ``default_compute_score``) or given as a callable, sync or
  ``async``. Called as veRL's reward managers call it: ``solution_str`` is the response text, the rest
  comes from the prompt's fields, the dataset row's ``data_source``, ``reward_model.ground_truth`` and
  ``extra_info``. A dict result's ``score`` is the reward, the rest its info (veRL's reward_extra_info).
- **OpenRLHF** (0.11): ``--remote_rm_url``, which its engines receive. A ``.py`` file defining
  ``reward_func(queries, prompts, labels, **kwargs)`` (``queries``: prompt + response text, special tokens
  kept) returning ``{"rewards", "scores", "extra_logs"}`` or a tensor of rewards; or reward-model server
  URLs answering a POST of ``{"query", "prompts", "labels"}`` with JSON holding ``"rewards"``. Called with
  one response at a time, as its ``SingleTurnAgentExecutor`` calls them; the prompt's label is
  ``metadata["label"]``; URLs take the responses in turn.

Each convention is built once per spec (cached), so every step hands ``rollout_step`` the same reward
and the stage's adaptive timeouts carry across steps.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
import json
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pat_engine.rollout.reward_fns import RewardInput

VERL_KEYS = {"path", "name", "reward_kwargs"}
HTTP_TIMEOUT_S = 180  # OpenRLHF's; the reward stage's own limit cuts it shorter


# ---- veRL -------------------------------------------------------------------------------------------------


def verl_reward(spec: Mapping[str, Any] | Callable) -> Callable[[RewardInput], Any]:
    """veRL's ``custom_reward_function`` mapping, or a ``compute_score`` callable, as a pat reward."""
    if callable(spec):
        return _verl_wrapped(spec, "{}")
    spec = _plain(spec)
    if not isinstance(spec, Mapping):
        raise ValueError(f"reward must be veRL's custom_reward_function ({sorted(VERL_KEYS)}) or a "
                         f"compute_score callable, got {type(spec).__name__}")
    unknown = sorted(set(spec) - VERL_KEYS)
    if unknown:
        raise ValueError(f"unknown custom_reward_function key(s) {unknown}; known: {sorted(VERL_KEYS)}")
    kwargs = json.dumps(dict(spec.get("reward_kwargs") or {}), sort_keys=True)
    return _verl_loaded(spec.get("path"), spec.get("name") or "compute_score", kwargs)


@functools.lru_cache(maxsize=16)
def _verl_loaded(path: str | None, name: str, kwargs: str) -> Callable[[RewardInput], Any]:
    if path is None:
        from verl.utils.reward_score import default_compute_score as fn
    else:
        from verl.utils.import_utils import load_extern_object

        fn = load_extern_object(module_path=path, object_name=name)
    return _verl_wrapped(fn, kwargs)


@functools.lru_cache(maxsize=16)
def _verl_wrapped(compute_score: Callable, kwargs: str) -> Callable[[RewardInput], Any]:
    extra = json.loads(kwargs)
    if inspect.iscoroutinefunction(compute_score):
        async def scored(item: RewardInput) -> Any:
            return _verl_value(await compute_score(**_verl_args(item), **extra))
    else:
        def scored(item: RewardInput) -> Any:
            return _verl_value(compute_score(**_verl_args(item), **extra))
    return scored


def _plain(spec: Any) -> Any:
    """``config.reward.custom_reward_function`` as it stands in veRL's Hydra config, as plain data."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # no veRL here: the spec is plain already
        return spec
    return OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec


def _verl_args(item: RewardInput) -> dict:
    fields = item.metadata
    if "data_source" not in fields:
        raise ValueError("veRL's compute_score needs the prompt's data_source: send each prompt as (uid, prompt "
                         "ids, {'data_source': ..., 'reward_model': {'ground_truth': ...}, 'extra_info': ...})")
    return {"data_source": fields["data_source"], "solution_str": item.response,
            "ground_truth": (fields.get("reward_model") or {}).get("ground_truth"),
            "extra_info": dict(fields.get("extra_info") or {})}


def _verl_value(result: Any) -> Any:
    if isinstance(result, Mapping):
        return {"reward": result["score"], **{k: v for k, v in result.items() if k != "score"}}
    return result


# ---- OpenRLHF ---------------------------------------------------------------------------------------------


def openrlhf_reward(remote_rm_url: str | Sequence[str], tokenizer: Any) -> Callable[[RewardInput], Any]:
    """OpenRLHF's ``remote_rm_url`` (a ``reward_func`` file or reward-model URLs) as a pat reward."""
    urls = (remote_rm_url,) if isinstance(remote_rm_url, str) else tuple(remote_rm_url)
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError(f"remote_rm_url must be a .py file or reward-model URLs, got {remote_rm_url!r}")
    if tokenizer is None:
        raise ValueError("OpenRLHF's rewards take texts: the model needs a tokenizer")
    return _openrlhf(urls, tokenizer)


@functools.lru_cache(maxsize=16)
def _openrlhf(urls: tuple[str, ...], tokenizer: Any) -> Callable[[RewardInput], Any]:
    if urls[0].endswith(".py"):
        reward_func = _reward_func(urls[0])
        return lambda item: _openrlhf_value(reward_func(*_openrlhf_args(item, tokenizer)))
    turn = itertools.cycle(urls)

    def posted(item: RewardInput) -> Any:
        queries, prompts, labels = _openrlhf_args(item, tokenizer)
        body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}).encode()
        req = urllib.request.Request(next(turn), body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return _openrlhf_value(json.loads(resp.read()))
    return posted


def _reward_func(path: str) -> Callable:
    """OpenRLHF's rule: the file's ``reward_func``."""
    spec = importlib.util.spec_from_file_location("pat_openrlhf_reward_func", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"remote_rm_url {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "reward_func", None)):
        raise ValueError(f"{path} defines no reward_func(queries, prompts, labels)")
    return module.reward_func


def _openrlhf_args(item: RewardInput, tokenizer: Any) -> tuple[list, list, list]:
    """One response as OpenRLHF's executor sends it: query = prompt + response text, special tokens kept."""
    out = item.output
    query = tokenizer.decode(list(out.prompt_token_ids) + list(out.token_ids), skip_special_tokens=False)
    prompt = item.prompt if isinstance(item.prompt, str) else tokenizer.decode(out.prompt_token_ids,
                                                                                skip_special_tokens=False)
    return [query], [prompt], [item.metadata.get("label")]


def _openrlhf_value(result: Any) -> Any:
    """``{"rewards", "scores", "extra_logs"}`` (or a bare tensor / list of rewards) for one response."""
    if not isinstance(result, Mapping):
        return _first(result)
    info = {"scores": _first(result["scores"])} if result.get("scores") is not None else {}
    logs = {k: _first(v) for k, v in (result.get("extra_logs") or {}).items()}
    return {"reward": _first(result["rewards"]), **info, **({"extra_logs": logs} if logs else {})}


def _first(value: Any) -> Any:
    """The one response's entry of a tensor, list or scalar (a batch of one)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return value[0] if isinstance(value, (list, tuple)) else value
