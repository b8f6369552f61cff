"""``pat-serve batch``: a JSONL file of prompts in, a JSONL file of results out, as fast as the engine goes.

By default every request is queued at once so continuous batching and the switch
policy see the whole long-tail batch; with ``tail_batching`` the lines run as
tail-batched rounds instead (``rounds.py``). With ``reward`` each answer is
scored as soon as it is generated, while the rest still generate
(``scoring.py``). Results are appended in the order they are done, one
flushed line each, so a killed job keeps what it finished; ``--resume`` skips
the keys already written. A bad line becomes an error record naming the line
and the problem, and the job goes on.
"""

from __future__ import annotations

import functools
import json
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from tqdm.auto import tqdm

from pat_engine.core.engine import Engine, RequestHandle
from pat_engine.errors import InvalidRequestError
from pat_engine.serve.batch.lines import (
    BatchItem,
    LineError,
    SamplingDefaults,
    error_record,
    finished_keys,
    is_openai_line,
    parse_line,
    result_record,
)
from pat_engine.serve.batch.rounds import TailBatchPolicy, run_rounds
from pat_engine.serve.batch.scoring import BatchReward, LineScorer
from pat_engine.serve.batch.summary import RewardCounts, RunSummary


@dataclass(frozen=True)
class BatchJob:
    input: Path
    output: Path
    model_name: str
    defaults: SamplingDefaults = SamplingDefaults()
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    timeline: Path | None = None  # write the layout timeline (JSON) here
    report: Path | None = None  # draw the timeline plot (PNG) here
    tail_batching: TailBatchPolicy | None = None  # run the lines as tail-batched rounds (rounds.py)
    reward: BatchReward | None = None  # score every answer as it finishes (scoring.py)
    tool_call_parser: str | None = None  # OpenAI chat lines with tools: calls parsed out (openai/tool_calls.py)
    reasoning_parser: str | None = None  # OpenAI chat lines: reasoning split off (openai/reasoning.py)


def load_items(job: BatchJob, engine: Engine, done: set[str]) -> tuple[list[BatchItem], list[LineError], int]:
    """Parse the input: runnable items, bad lines, and how many lines were skipped as already done."""
    items: list[BatchItem] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    skipped = 0
    openai_file = None  # the file's style, for lines too broken to tell
    with job.input.open("r", encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                err = LineError(n, f"invalid JSON: {exc}", openai=bool(openai_file))
                if err.key not in done:
                    errors.append(err)
                else:
                    skipped += 1
                continue
            if openai_file is None:
                openai_file = is_openai_line(obj)
            try:
                item = parse_line(n, obj, engine.tokenizer, engine.max_model_len, job.defaults,
                                  job.tool_call_parser, job.reasoning_parser)
                key = item.key
            except LineError as exc:
                item, key = None, exc.key
                err = exc
            if key in done:
                skipped += 1
                continue
            if key in seen:
                errors.append(LineError(n, f"duplicate id {key!r} (first on line {seen[key]})", openai=is_openai_line(obj)))
                continue
            seen[key] = n
            if item is None:
                errors.append(err)
            else:
                items.append(item)
    return items, errors, skipped


class _Writer:
    """Appends one flushed JSON line per record and keeps the run's counts."""

    def __init__(self, f: IO[str], summary: RunSummary, bar: Any):
        self.f, self.summary, self.bar = f, summary, bar

    def line(self, item: BatchItem, outs: list, rewards: list | None, tokenizer: Any, model: str) -> None:
        """One input line's result record."""
        self.write(result_record(item, outs, tokenizer, model, rewards),
                   prompt_tokens=len(outs[0].prompt_token_ids), tokens=sum(len(o.token_ids) for o in outs))

    def write(self, record: dict, prompt_tokens: int = 0, tokens: int = 0) -> None:
        self.f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.f.flush()
        s = self.summary
        s.requests += 1
        s.errors += record.get("error") is not None
        s.prompt_tokens += prompt_tokens
        s.tokens += tokens
        self.bar.update(1)


def check_paths(job: BatchJob) -> None:
    """Refuse a missing input or an existing output (without --resume/--overwrite) before any engine starts."""
    if not job.input.is_file():
        raise InvalidRequestError(f"input file {job.input} does not exist")
    if job.output.exists() and job.output.stat().st_size and not (job.resume or job.overwrite):
        raise InvalidRequestError(f"{job.output} exists; pass --resume to continue it or --overwrite to replace it")


def _open_output(job: BatchJob) -> set[str]:
    check_paths(job)
    if job.overwrite and not job.resume:
        job.output.unlink(missing_ok=True)
    return finished_keys(job.output) if job.resume else set()


def run_batch(engine: Engine, job: BatchJob) -> RunSummary:
    done = _open_output(job)
    items, bad, skipped = load_items(job, engine, done)
    summary = RunSummary(skipped=skipped)
    switches_before = len(engine.switches)
    job.output.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(items) + len(bad), desc="pat-serve batch", unit="req", disable=not job.progress,
               dynamic_ncols=True)
    start = time.perf_counter()
    progress = functools.partial(_postfix, bar, summary, engine, start, switches_before)
    try:
        with job.output.open("a", encoding="utf-8") as f:
            out = _Writer(f, summary, bar)
            for err in bad:
                out.write(error_record(err))
            if job.tail_batching is None:
                summary.rewards = _queue_all(engine, job, items, out, progress)
            else:
                summary.rounds, summary.rewards = run_rounds(engine, items, job.tail_batching, out, job.model_name,
                                                             progress, job.reward)
    except KeyboardInterrupt:
        bar.close()
        print(f"\ninterrupted: {summary.requests} results written to {job.output}, "
              f"{len(items) + len(bad) - summary.requests} lines not written; run again with --resume to finish")
        raise
    bar.close()
    summary.wall_s = time.perf_counter() - start
    summary.switches = [_describe(s) for s in engine.switches[switches_before:] if s.ok]
    _write_artifacts(engine, job, summary)
    return summary


def _queue_all(engine: Engine, job: BatchJob, items: list[BatchItem], out: _Writer,
               progress: Callable[[], None]) -> RewardCounts | None:
    """Submit every line at once; write each as its samples finish (and, with a reward, are scored).
    Ctrl-C aborts what is in flight."""
    finished: queue.Queue[tuple[BatchItem, list[RequestHandle]]] = queue.Queue()
    outstanding: dict[int, tuple[BatchItem, list[RequestHandle]]] = {}
    scorer = LineScorer(job.reward, lambda item, outs, rewards: out.line(item, outs, rewards, engine.tokenizer,
                                                                        job.model_name))
    try:
        for item in items:
            try:
                handles = engine.submit_samples(item.input.prompt, item.input.params,
                                                request_id=f"batch-line-{item.line}")
            except InvalidRequestError as exc:  # e.g. longer than the context: only the engine knows
                out.write(error_record(item.error(str(exc))))
                continue
            outstanding[item.line] = (item, handles)
            for handle in handles:  # a line is done when all its samples are
                handle.add_listener(lambda h, pair=(item, handles): all(x.done() for x in pair[1])
                                    and finished.put(pair))
            if all(h.done() for h in handles):
                finished.put((item, handles))
            _drain(finished, outstanding, scorer, block=False)
        while outstanding:
            _drain(finished, outstanding, scorer, block=True)
            progress()
        scorer.finish()
    except KeyboardInterrupt:
        engine.abort([hs[0].request_id for _, hs in outstanding.values()])
        raise
    finally:
        scorer.close()
    return scorer.counts if scorer.stage is not None else None


def _drain(finished: queue.Queue, outstanding: dict, scorer: LineScorer, block: bool) -> None:
    while outstanding:
        try:
            item, handles = finished.get(timeout=scorer.poll_s if scorer.stage else 0.5) if block else finished.get_nowait()
        except queue.Empty:
            break
        if outstanding.pop(item.line, None) is None:
            continue  # already handed on (the listener and the done() check both reported it)
        scorer.finished(item, [h.output() for h in handles])
        block = False  # after one result, take whatever else is ready without waiting
    scorer.poll()


def _postfix(bar: Any, summary: RunSummary, engine: Engine, start: float, switches_before: int) -> None:
    elapsed = max(time.perf_counter() - start, 1e-9)
    made = sum(1 for s in engine.switches[switches_before:] if s.ok)
    bar.set_postfix_str(f"{summary.tokens / elapsed:.0f} tok/s, {engine.layout}, {made} switches", refresh=True)


def _describe(s: Any) -> str:
    return f"{s.from_layout}->{s.to_layout} at {s.t:.1f} s, {s.seconds:.2f} s {s.kv_path}"


def _write_artifacts(engine: Engine, job: BatchJob, summary: RunSummary) -> None:
    if job.timeline is None and job.report is None:
        return
    timeline = {**engine.timeline, "summary": summary.to_dict(), "title": "pat-serve batch: " + summary.line()}
    if job.timeline is not None:
        job.timeline.parent.mkdir(parents=True, exist_ok=True)
        job.timeline.write_text(json.dumps(timeline, indent=1))
    if job.report is not None:
        from pat_engine.serve.batch.report import plot_timeline  # matplotlib only when a report is asked for

        plot_timeline(timeline, job.report)
