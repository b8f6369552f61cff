"""Scripted tools and environments for the multi-turn agent tests and benchmark (deterministic answers).

A tiny random model writes no tool calls, so the scripts decide them: every turn ends at one of
``STOPS`` (as a model ends its tool call with a special token) and calls the tool with the turn's
last token as its argument. ``VERL_TOOLS`` is a veRL ``function_tool_path`` file (a function tool and
the tool parser ``pat_scripted``); ``OPENRLHF_AGENT`` an OpenRLHF ``agent_func_path`` file.
``segments`` splits an agent output into its turns.
"""

from __future__ import annotations

STOPS = list(range(0, 390, 13))  # token ids that end a turn (the tiny model's vocabulary is 390)
TURNS = 3

VERL_TOOLS = f'''
"""veRL tools for the agent tests: the scripted tool, and a parser that calls it after every turn."""
import json

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.function_tool import function_tool


@function_tool
def lookup(key: int) -> str:
    """Look a key up in a fixed table.

    Args:
        key: the key to look up
    """
    return f"value {{key % 97}} for key {{key}}"


@ToolParser.register("pat_scripted")
class ScriptedCalls(ToolParser):
    """Each turn calls lookup with its last token as the key, and ends at one of the stop tokens."""

    @property
    def stop_token_ids(self):
        return {STOPS!r}

    async def extract_tool_calls(self, responses_ids, tools=None):
        return "", [FunctionCall(name="lookup", arguments=json.dumps({{"key": int(responses_ids[-1])}}))]
'''

OPENRLHF_AGENT = f'''
"""An OpenRLHF multi-turn agent for the tests: a scripted environment answers each action and ends the
episode after {TURNS} actions. AgentExecutor is OpenRLHF's own MultiTurnAgentExecutor where openrlhf is
importable. Elsewhere (this repository's CI: OpenRLHF pins CUDA-only packages) a stand-in follows that
class's contract as openrlhf/utils/agent.py of 0.11.2 defines it: tokenize the observation without
special tokens; per turn set max_tokens to what is left of max_length, call
llm_engine.generate(tokens, a copy of the params, multi_modal_data=None), record the action's token
range, append the action's tokens and the tokenized feedback (log-probs 0 for feedback tokens); stop
when the environment says done or the budget is spent; return the same dict keys.
"""
import copy

import torch

try:
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
except ImportError:
    AgentInstanceBase, MultiTurnAgentExecutor = object, None


class Env(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {{"observation": states["observation"]}}

    async def step(self, states, **kwargs):
        self.turn += 1
        feedback = f" result {{len(states['action_text']) % 97}} then"
        return {{"rewards": torch.tensor(0.0), "scores": torch.tensor(0.0), "environment_feedback": feedback,
                "done": self.turn >= {TURNS}, "sampling_params": states["sampling_params"], "extra_logs": {{}}}}


class StandInExecutor:
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        env = Env()
        text = (await env.reset({{"observation": prompt, "label": label}}))["observation"]
        tokens = hf_tokenizer(text=text, add_special_tokens=False)["input_ids"]
        ranges, logprobs = [], [0.0] * len(tokens)
        while True:
            sampling_params.max_tokens = max_length - len(tokens)
            if sampling_params.max_tokens <= 0:
                break
            out = await llm_engine.generate(tokens, copy.deepcopy(sampling_params), multi_modal_data=None)
            action = out.outputs[0]
            ranges.append((len(tokens), len(tokens) + len(action.token_ids)))
            result = await env.step({{"observation_text": text, "action_text": action.text, "label": label,
                                      "sampling_params": sampling_params}})
            feedback = hf_tokenizer(text=result["environment_feedback"], add_special_tokens=False)["input_ids"]
            text += action.text + result["environment_feedback"]
            tokens = tokens + list(action.token_ids) + feedback
            logprobs += [d[t].logprob for t, d in zip(action.token_ids, action.logprobs)] + [0.0] * len(feedback)
            if result["done"]:
                break
        return {{"prompt": prompt, "label": label, "observation_tokens": tokens, "action_ranges": ranges,
                "rollout_log_probs": logprobs, "reward": 0.0, "scores": 0.0, "extra_logs": {{}}}}


if MultiTurnAgentExecutor is not None:
    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(Env)
else:
    AgentExecutor = StandInExecutor
'''


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal values in a response mask: (value, start, end); 1 = the model's turn, 0 = a tool's."""
    runs: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1], i + 1)
        else:
            runs.append((m, i, i + 1))
    return runs


def reusable(context: int, block: int) -> int:
    """Tokens a later turn finds cached from a turn whose prompt + response held ``context`` tokens:
    every full block whose KV was computed (all but the last sampled token's)."""
    return (context - 1) // block * block
