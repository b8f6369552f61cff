"""``pat-serve``: batch job, OpenAI-compatible server, timeline plot, and demo.

    pat-serve batch --model M --input prompts.jsonl --output results.jsonl --world 4 --switch-schedule 32:4
    pat-serve batch --model M --input prompts.jsonl --output results.jsonl --tail-batching --prompts-per-round 64
    pat-serve batch --model M --input prompts.jsonl --output results.jsonl --reward "python verify.py"
    pat-serve serve --model M --world 2 --port 8000
    pat-serve plot timeline.json -o timeline.png
    pat-serve demo
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from pat_engine import env
from pat_engine.errors import PatEngineError
from pat_engine.rollout.rewards import RewardConfig


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM ends a job the way Ctrl-C does: abort, keep what is written


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling defaults (pat-style lines may override each; OpenAI lines use their body)")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed for every request (default: per request)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    g.add_argument("--logprobs", action="store_true", help="return each chosen token's log-probability")


def build_parser() -> argparse.ArgumentParser:
    from pat_engine.serve.engine_args import add_engine_args

    parser = argparse.ArgumentParser(prog="pat-serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("batch", help="generate for a JSONL file of prompts")
    b.add_argument("--input", required=True, type=Path, help="JSONL: pat-style lines or OpenAI Batch API lines")
    b.add_argument("--output", required=True, type=Path, help="JSONL results, appended as requests finish")
    add_engine_args(b)
    _add_sampling_args(b)
    _add_answer_parsing_args(b)
    mode = b.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="skip ids already in --output and append the rest")
    mode.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    b.add_argument("--report", type=Path, default=None, help="draw the layout timeline to this PNG")
    b.add_argument("--timeline", type=Path, default=None, help="write the layout timeline to this JSON file")
    b.add_argument("--served-model-name", default=None, help="model name in OpenAI-style results")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    t = b.add_argument_group("tail batching (RollPacker rounds; docs/pat-serve.md)")
    t.add_argument("--tail-batching", action="store_true",
                   help="run the lines as rounds: short rounds over-provision and return the first P0 lines to "
                        "finish, the others finish later in long rounds; every line is answered")
    t.add_argument("--prompts-per-round", type=int, default=None, metavar="P0",
                   help="lines each round returns (required with --tail-batching)")
    t.add_argument("--tail-eta", type=float, default=None, metavar="ETA",
                   help="short rounds launch ceil(P0*(1+ETA)) lines x ceil(n*(1+ETA)) responses (default 0.25)")

    r = b.add_argument_group("rewards, scored while the rest still generate (docs/pat-serve.md)")
    r.add_argument("--reward", default=None, metavar="CMD|MODULE:FUNCTION",
                   help="score every answer as it finishes: a command run once per answer (the answer as JSON on "
                        "stdin, its reward as the last stdout line) or a Python function module:function")
    r.add_argument("--reward-workers", type=int, default=None, metavar="N",
                   help=f"rewards running at once (default {RewardConfig.max_workers})")
    r.add_argument("--reward-timeout", type=float, default=None, metavar="S",
                   help=f"a fixed limit per reward (default: RollPacker's adaptive limit per line, "
                        f"{RewardConfig.t_min:g}-{RewardConfig.t_max:g} s)")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    _add_answer_parsing_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    s.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: the path)")
    s.add_argument("--max-queued-requests", type=int, default=256, help="requests in flight before new ones get 503")
    s.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body; larger ones get 413 before they are read (default 16 MiB)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                        "(default: the PAT_API_KEY environment variable, if set)")
    s.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                   help="on SIGTERM, seconds running requests may take to finish before they are cut off "
                        "(default 20)")
    s.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))

    p = sub.add_parser("plot", help="draw a timeline JSON (from batch --timeline or GET /pat/timeline) to a PNG")
    p.add_argument("timeline", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--title", default=None)

    d = sub.add_parser("demo", help="long-tail batch on the built-in tiny model with live switching (CPU, no download)")
    from pat_engine.serve.demo import DemoConfig, default_model_dir

    d.add_argument("--model-dir", type=Path, default=default_model_dir(), help="where the tiny model is (created if absent)")
    d.add_argument("--out-dir", type=Path, default=DemoConfig.out_dir, help="prompts, results, timeline and report")
    d.add_argument("--requests", type=int, default=DemoConfig.requests)
    d.add_argument("--world", type=int, default=DemoConfig.world, help="CPU worker processes")
    d.add_argument("--tail-tokens", type=int, default=DemoConfig.tail_tokens,
                   help="length of the longest answers; the others scale with it")
    d.add_argument("--profile", type=Path, default=None, help="latency table: let the controller decide")
    d.add_argument("--no-progress", action="store_true")
    return parser


def _batch(ns: argparse.Namespace) -> int:
    from pat_engine.serve.batch.job import BatchJob, check_paths, run_batch
    from pat_engine.serve.batch.lines import SamplingDefaults
    from pat_engine.serve.engine_args import EngineArgs

    defaults = SamplingDefaults(ns.max_tokens, ns.temperature, ns.top_p, ns.top_k, ns.sampling_seed, ns.ignore_eos,
                                ns.logprobs)
    job = BatchJob(ns.input, ns.output, ns.served_model_name or ns.model, defaults, ns.resume, ns.overwrite,
                   not ns.no_progress, ns.timeline, ns.report, _tail_policy(ns), _reward(ns), _tool_call_parser(ns),
                   ns.reasoning_parser)
    check_paths(job)
    engine = EngineArgs.from_namespace(ns).build()
    try:
        summary = run_batch(engine, job)
    finally:
        engine.shutdown()
    print(f"pat-serve batch: {summary.line()}")
    print(f"results: {job.output}" + (f"; report: {job.report}" if job.report else "")
          + (f"; timeline: {job.timeline}" if job.timeline else ""))
    return 0


def _tail_policy(ns: argparse.Namespace):
    """The tail-batching policy from the flags (None without --tail-batching), checked before the engine starts."""
    from pat_engine.serve.batch.rounds import TailBatchPolicy

    if not ns.tail_batching:
        if ns.prompts_per_round is not None or ns.tail_eta is not None:
            raise PatEngineError("--prompts-per-round and --tail-eta need --tail-batching")
        return None
    if ns.prompts_per_round is None:
        raise PatEngineError("--tail-batching needs --prompts-per-round P0")
    eta = TailBatchPolicy.eta if ns.tail_eta is None else ns.tail_eta
    return TailBatchPolicy(ns.prompts_per_round, eta)


def _reward(ns: argparse.Namespace):
    """The reward from the flags (None without --reward), loaded and checked before the engine starts."""
    from pat_engine.rollout.reward_fns import reward_from_spec
    from pat_engine.serve.batch.scoring import BatchReward

    if ns.reward is None:
        if ns.reward_workers is not None or ns.reward_timeout is not None:
            raise PatEngineError("--reward-workers and --reward-timeout need --reward")
        return None
    options = {"max_workers": ns.reward_workers, "timeout_s": ns.reward_timeout}
    try:
        config = RewardConfig(**{k: v for k, v in options.items() if v is not None})
    except ValueError as exc:
        raise PatEngineError(f"--reward-workers / --reward-timeout: {exc}") from None
    return BatchReward(reward_from_spec(ns.reward), config)


def _serve(ns: argparse.Namespace) -> int:
    from pat_engine.serve.engine_args import EngineArgs
    from pat_engine.serve.launcher import bind_socket, bound_port, run_foreground
    from pat_engine.serve.server import build_app

    config = _server_config(ns)
    engine = EngineArgs.from_namespace(ns).build()
    failure = None
    try:
        app = build_app(engine, config)
        sock = bind_socket(ns.host, ns.port)
        name = config.served_model_name
        print(f"pat-serve: serving {name!r} ({engine.layout}) on http://{ns.host}:{bound_port(sock)}", flush=True)
        failure = run_foreground(app, sock, ns.log_level, config.drain_timeout_s, app.state.pat.begin_drain,
                                 watch=lambda: engine.dead)
    except KeyboardInterrupt:
        pass  # SIGINT/SIGTERM after uvicorn's graceful stop
    finally:
        engine.shutdown()
    if failure is not None:  # a supervisor should restart us: the engine cannot serve
        print(f"pat-serve serve: error: {failure}", file=sys.stderr, flush=True)
        return 1
    print("pat-serve: stopped", flush=True)
    return 0


def _server_config(ns: argparse.Namespace):
    """ServerConfig from the flags, checked before the engine starts."""
    from pat_engine.serve.state import DEFAULT_MAX_BODY_BYTES, ServerConfig

    if ns.max_queued_requests < 1:
        raise PatEngineError("--max-queued-requests must be at least 1")
    body = DEFAULT_MAX_BODY_BYTES if ns.max_body_bytes is None else ns.max_body_bytes
    if body < 1:
        raise PatEngineError("--max-body-bytes must be at least 1")
    drain = 20.0 if ns.drain_timeout is None else ns.drain_timeout
    if not drain >= 0:
        raise PatEngineError("--drain-timeout must be >= 0")
    api_key = ns.api_key if ns.api_key is not None else env.api_key()
    return ServerConfig(ns.served_model_name or ns.model, ns.max_queued_requests, body, api_key, drain,
                        _tool_call_parser(ns), ns.reasoning_parser)


def _add_answer_parsing_args(p: argparse.ArgumentParser) -> None:
    from pat_engine.serve.openai.reasoning import REASONING_PARSERS
    from pat_engine.serve.openai.tool_calls import TOOL_CALL_PARSERS

    g = p.add_argument_group("chat answers: reasoning and tool calls (vLLM's flags; docs/pat-serve.md)")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split what a thinking model writes before </think> into the message's reasoning: "
                        "deepseek_r1 (DeepSeek-R1, QwQ), qwen3")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls out of the answers of chats that offer tools (tool_choice "auto")')
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                   help="the calls' format: hermes (Qwen2.5, Qwen3, Hermes: <tool_call>{json}</tool_call>), "
                        "llama3_json (Llama 3.1-3.3); SGLang's names qwen25, qwen, llama3 are aliases")


def _tool_call_parser(ns: argparse.Namespace) -> str | None:
    """The parser's name when both flags are given; one without the other is an error naming the other."""
    if ns.enable_auto_tool_choice != (ns.tool_call_parser is not None):
        missing = "--tool-call-parser" if ns.enable_auto_tool_choice else "--enable-auto-tool-choice"
        raise PatEngineError(f"tool calls need --enable-auto-tool-choice and --tool-call-parser together; "
                             f"{missing} is missing")
    return ns.tool_call_parser


def _plot(ns: argparse.Namespace) -> int:
    from pat_engine.serve.batch.report import plot_timeline

    try:
        timeline = json.loads(ns.timeline.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PatEngineError(f"cannot read timeline {ns.timeline}: {exc}") from None
    out = plot_timeline(timeline, ns.output, ns.title)
    print(f"report: {out}")
    return 0


def _demo(ns: argparse.Namespace) -> int:
    from pat_engine.serve.demo import DemoConfig, run_demo

    cfg = DemoConfig(ns.model_dir.expanduser(), ns.out_dir, ns.requests, ns.world, ns.tail_tokens, ns.profile,
                     not ns.no_progress)
    res = run_demo(cfg)
    paths = res.paths
    print(f"pat-serve demo: {res.summary.line()}")
    print(f"report: {paths['report.png']}  (results: {paths['results.jsonl']}, timeline: {paths['timeline.json']})")
    if res.profile is None:
        print("note: the fixed schedule shows the mechanism, not a speed-up: on CPU workers a higher TP degree is "
              "often slower (4 worker processes share 2 cores here, and every layer adds collectives). Give a pat-profile table "
              "(--profile) and the controller switches only when its prediction says it pays.")
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _terminate)
    run = {"batch": _batch, "serve": _serve, "plot": _plot, "demo": _demo}[ns.command]
    try:
        rc = run(ns)
    except KeyboardInterrupt:
        return 130
    except (PatEngineError, NotImplementedError, OSError) as exc:
        print(f"pat-serve {ns.command}: error: {exc}", file=sys.stderr)
        return 1
    if ns.command == "serve":
        # Everything is closed (workers stopped, socket shut). Tearing the interpreter down with torch and
        # transformers loaded takes seconds on a busy host; a supervisor waiting on SIGTERM should not.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
