"""lm-eval against a live pat-serve: a generate_until task (stop strings) and a multiple-choice
loglikelihood task (echo + prompt logprobs), both local YAMLs with inline examples (no hub access).

lm-eval runs as a subprocess with ``--model local-completions`` pointed at pat-serve's
/v1/completions on a free loopback port. It is looked for in this interpreter, then in
``$PAT_LM_EVAL_PYTHON``, then in ``.pat-cache/venv-lmeval`` (created with
``pip install "lm-eval[api]"`` on first use, sharing this interpreter's torch). If it cannot be
had, the script says why and exits 0 without a result (``--no-install`` skips the install).

    PYTHONPATH=.:profiler python bench/lm_eval_smoke.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".pat-cache" / "venv-lmeval"

GEN = [  # generate_until: the model stops at the first "." or newline (the until strings)
    {"question": "Count: one two three", "answer": " four"},
    {"question": "The sky is", "answer": " blue"},
    {"question": "2 + 2 =", "answer": " 4"},
    {"question": "Say hello:", "answer": " hello"},
]
MC = [  # multiple choice scored by loglikelihood of each continuation
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a banana"], "label": 0},
    {"question": "Water is", "choices": [" wet", " dry"], "label": 0},
    {"question": "One plus one is", "choices": [" two", " seven", " blue", " none"], "label": 0},
]


def lm_eval_python(install: bool) -> tuple[str | None, str]:
    """A Python that can run ``lm_eval``, or None and the reason."""
    candidates = [sys.executable, os.environ.get("PAT_LM_EVAL_PYTHON"), str(VENV / "bin" / "python")]
    for py in candidates:
        if py and Path(py).exists() and subprocess.run([py, "-c", "import lm_eval"], capture_output=True).returncode == 0:
            return py, ""
    if not install:
        return None, "lm-eval is not installed (run without --no-install, or set PAT_LM_EVAL_PYTHON)"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
    r = subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "lm-eval[api]"], capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"pip install lm-eval[api] failed: {r.stderr.strip().splitlines()[-1:]}"
    return str(VENV / "bin" / "python"), ""


def write_tasks(folder: Path) -> None:
    for name, rows in (("gen", GEN), ("mc", MC)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = lambda name: f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\ntest_split: test\n"  # noqa: E731
    (folder / "pat_gen_until.yaml").write_text(
        "task: pat_gen_until\n" + data("gen") + "output_type: generate_until\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 12\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")
    (folder / "pat_mc.yaml").write_text(
        "task: pat_mc\n" + data("mc") + "output_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\n"
        "metric_list:\n  - metric: acc\n")


def run(python: str, model_dir: str, url: str, folder: Path) -> dict:
    out = folder / "out"
    args = [python, "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={model_dir},"
            "num_concurrent=1,max_retries=1,tokenized_requests=True",
            "--tasks", "pat_gen_until,pat_mc", "--include_path", str(folder), "--output_path", str(out),
            "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    results = next(out.rglob("results_*.json"))
    return json.loads(results.read_text())["results"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-install", action="store_true")
    args = ap.parse_args()
    python, why = lm_eval_python(not args.no_install)
    if python is None:
        print(f"skipped: {why}")
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    from common import markdown_table, write_result
    from pat_engine import Engine
    from pat_engine.serve.launcher import BackgroundServer
    from pat_engine.serve.server import ServerConfig, build_app
    from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="pat-lmeval-"))
    model_dir = str(write_tiny_model(folder / "model", TinyModelSpec(arch="llama", num_kv_heads=2)))
    write_tasks(folder)
    with Engine(model_dir, tp=1, dp=2, dtype="float32", max_model_len=256) as engine, \
            BackgroundServer(build_app(engine, ServerConfig("tiny", max_queued_requests=64))) as srv:
        results = run(python, model_dir, srv.url, folder)
    rows = [[task, metric, value] for task, res in sorted(results.items())
            for metric, value in sorted(res.items()) if isinstance(value, (int, float)) and "stderr" not in metric]
    body = ("lm-eval `local-completions` against pat-serve (tiny random Llama, TP1xDP2, float32): both tasks ran to "
            "completion. Scores of a random model mean nothing; what is shown is that every request "
            "(`until` stop strings, `echo` + `logprobs` loglikelihoods) was answered.\n\n"
            + markdown_table(["task", "metric", "value"], rows))
    write_result("lm_eval_smoke", "lm-eval against pat-serve", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
