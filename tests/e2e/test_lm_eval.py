"""lm-evaluation-harness itself (``local-completions``, offline) against the real stack: a
log-likelihood multiple-choice task, a rolling log-likelihood (perplexity) task and a generation
task, built from rows of the shared Alpaca data. The model has random weights, so the scores mean
nothing; what is checked is that every request lm-eval sends is answered in the shape it parses
(echo + logprobs for log-likelihoods: cohort's prompt logprobs) — 0 errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cohort.datasets import load_jsonl, shared_data_dir
from cohort.tokenizer import tokenizer_path

pytestmark = [pytest.mark.e2e, pytest.mark.data]
STACK_ENV = {"COHORT_SERVED_MODEL_NAME": "cohort-tiny"}
ROWS = 12

TASKS = {
    "cohort_mc": """
task: cohort_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data}"}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Instruction: {{{{instruction}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
""",
    "cohort_ppl": """
task: cohort_ppl
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data}"}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{output}}}}"
metric_list:
  - metric: word_perplexity
""",
    "cohort_gen": """
task: cohort_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data}"}}}}
test_split: test
output_type: generate_until
doc_to_text: "Instruction: {{{{instruction}}}}\\nAnswer:"
doc_to_target: "{{{{output}}}}"
generation_kwargs: {{until: ["\\n\\n"], max_gen_toks: 8}}
metric_list:
  - metric: exact_match
""",
}


def _write_tasks(folder: Path) -> None:
    rows = load_jsonl(shared_data_dir() / "alpaca.jsonl.gz", limit=ROWS + 1)
    docs = [{"instruction": r.instruction, "output": r.output[:200],
             "choices": [r.output[:120], rows[i + 1].output[:120]]} for i, r in enumerate(rows[:ROWS])]
    data = folder / "alpaca_rows.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    for name, yaml in TASKS.items():
        (folder / f"{name}.yaml").write_text(yaml.format(data=data))


def test_lm_eval_loglikelihood_and_generation_tasks_run_with_no_error(stack, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _write_tasks(tmp_path)
    model_args = (f"model=cohort-tiny,base_url={stack.url}/v1/completions,tokenizer={tokenizer_path()},"
                  "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=4,max_retries=1,"
                  "max_length=2048,"
                  # the built-in model's BERT vocabulary has no EOS: cohort uses [SEP] (id 102) as one
                  "custom_prefix_token_id=102,eos_string=[SEP]")
    out = simple_evaluate(model="local-completions", model_args=model_args, tasks=list(TASKS),
                          task_manager=TaskManager(include_path=str(tmp_path)), limit=ROWS,
                          bootstrap_iters=0, log_samples=True)
    assert out is not None
    results = out["results"]
    assert 0.0 <= results["cohort_mc"]["acc,none"] <= 1.0
    assert results["cohort_ppl"]["word_perplexity,none"] > 1.0
    assert "exact_match,none" in results["cohort_gen"]
    for task in TASKS:
        assert len(out["samples"][task]) == ROWS, task
    mc = out["samples"]["cohort_mc"][0]["resps"]  # [[(loglikelihood, is_greedy)], ...] per choice
    assert len(mc) == 2 and all(r[0][0] < 0 for r in mc)
    gen = [s["resps"][0][0] for s in out["samples"]["cohort_gen"]]
    assert all(isinstance(g, str) for g in gen) and any(gen)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
