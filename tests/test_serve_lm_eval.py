"""A client nobody here wrote: lm-evaluation-harness's ``local-completions`` model against the server.

Three small local tasks (``tests/lm_eval_tasks/engine_smoke``, no hub): multiple choice (loglikelihood:
``echo`` + ``logprobs: 1`` + ``max_tokens: 1`` on token-id prompts), perplexity (loglikelihood_rolling:
the same, after a prefix token) and generate-until (greedy, five stop strings). lm-eval sends four
prompts per request (list prompts). On the tiny random checkpoint, offline: a connection to anything
but the loopback address fails the run. The scores are meaningless; what is checked is that the
numbers lm-eval received are the engine's own forward pass, and its generations the engine's greedy text.

By hand, against ``python -m engine_lib serve --model CKPT`` (the same tasks, the same requests):
    lm_eval --model local-completions --model_args model=CKPT,base_url=http://127.0.0.1:8000/v1/completions,\
tokenizer=CKPT,tokenizer_backend=huggingface --batch_size 4 --include_path tests/lm_eval_tasks --tasks engine_smoke
"""

import os
import socket
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm_eval imports datasets, which reads it once
pytest.importorskip("fastapi")
pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (the eval extra)")

from serve_helpers import NAME, metrics, start  # noqa: E402

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
ITEMS = {"engine_smoke_choice": 6, "engine_smoke_rolling": 3, "engine_smoke_gen": 4}  # lines in each JSONL
CHOICES = 3  # per multiple-choice item
BATCH = 4  # prompts per request
MAX_GEN_TOKS = 8  # engine_smoke_gen.yaml
TOL = 1e-3  # fp32 serving vs the fp32 full forward, per token (as tests/test_serve_logprobs.py)


def loopback_only(mp: pytest.MonkeyPatch) -> None:
    """Refuse every connection not to 127.0.0.1 or ::1, and tell the HF libraries they are offline."""
    real = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1"):
            raise AssertionError(f"lm-eval tried to reach {address}")
        return real(sock, address)

    mp.setattr(socket.socket, "connect", connect)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(name, "1")
    mp.setenv("OPENAI_API_KEY", "unused")  # local-completions sends it as a Bearer token; our server has none


@pytest.fixture(scope="module")
def engine(engines):
    return engines("kv_cache")


def evaluate(engine, tiny_dir, tasks: list[str], **options):
    """lm-eval over ``tasks`` against a fresh server -> (its LM object, its output, the server's metrics after)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as mp:
        loopback_only(mp)
        srv = start(engine)
        try:
            lm = LocalCompletionsAPI(model=NAME, base_url=f"{srv.url}/v1/completions", tokenizer=str(tiny_dir),
                                     tokenizer_backend="huggingface", max_retries=1, **options)
            out = simple_evaluate(model=lm, tasks=tasks, log_samples=True, bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False))
            return lm, out, metrics(srv.url)
        finally:
            srv.stop()


@pytest.fixture(scope="module")
def run(engine, tiny_dir):
    """The three tasks, four prompts per request, one request at a time."""
    pytest.importorskip("tenacity", reason="tenacity is missing: lm-eval's API models need "
                        "its api extra (pip install 'lm-eval[api]'; requirements-lock.txt has it)")
    return evaluate(engine, tiny_dir, list(ITEMS), num_concurrent=1, batch_size=BATCH)


def counter(values: dict, name: str, **labels) -> float:
    """A counter from /metrics, whatever other labels (model_name) it carries."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    found = [v for key, v in values.items() if key.startswith(name + "{") and all(w in key for w in want)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_every_task_reports_every_item(run):
    _, out, _ = run
    for task, n in ITEMS.items():
        assert out["results"][task]["sample_len"] == n
        assert len(out["samples"][task]) == n
    assert 0 <= out["results"]["engine_smoke_choice"]["acc,none"] <= 1
    assert 0 <= out["results"]["engine_smoke_gen"]["exact_match,none"] <= 1
    assert out["results"]["engine_smoke_rolling"]["word_perplexity,none"] > 1


def test_no_request_failed(run):
    """Each prompt of each request completed; none was refused, errored or cancelled (max_retries=1:
    a failed request would have failed the run, but a retried one would not show otherwise)."""
    _, _, after = run
    sequences = ITEMS["engine_smoke_choice"] * CHOICES + ITEMS["engine_smoke_rolling"] + ITEMS["engine_smoke_gen"]
    assert counter(after, "engine_requests_total", outcome="completed") == sequences
    for outcome in ("invalid", "error", "rejected", "cancelled"):
        assert counter(after, "engine_requests_total", outcome=outcome) == 0, outcome


def reference(engine, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The engine's own (loglikelihood, is_greedy) of ``continuation`` after ``context``."""
    lp = engine.logits(context + continuation).log_softmax(dim=-1)[len(context) - 1:-1]
    target = torch.tensor(continuation)
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(dim=-1) == target).all())


def test_loglikelihoods_are_the_engines_own(run, engine):
    lm, out, _ = run
    samples = out["samples"]["engine_smoke_choice"]
    for sample in samples:
        for (context, continuation), (got, greedy) in zip(sample["arguments"], sample["filtered_resps"]):
            ctx, cont = lm._encode_pair(context, continuation)
            want, want_greedy = reference(engine, ctx, cont)
            assert got == pytest.approx(want, abs=TOL * len(cont)), (context, continuation)
            assert greedy == want_greedy, (context, continuation)
    assert len({round(r[0], 3) for s in samples for r in s["filtered_resps"]}) > CHOICES  # not a constant


def test_rolling_loglikelihoods_are_the_engines_own(run, engine):
    lm, out, _ = run
    for sample in out["samples"]["engine_smoke_rolling"]:
        (text,) = sample["arguments"][0]
        ids = lm.tok_encode(text)
        want, _ = reference(engine, [lm.prefix_token_id], ids)  # one window: the texts are short
        assert sample["filtered_resps"][0] == pytest.approx(want, abs=TOL * len(ids)), text


def test_generations_are_the_engines_greedy_text_cut_at_the_stops(run, engine):
    lm, out, _ = run
    for sample in out["samples"]["engine_smoke_gen"]:
        context, gen_kwargs = sample["arguments"][0]
        text = engine.generate(lm.tok_encode(context), max_new_tokens=MAX_GEN_TOKS, do_sample=False).text
        for stop in [*gen_kwargs["until"], lm.eos_string]:
            text = text.split(stop)[0]
        assert sample["filtered_resps"][0] == text, context


def test_concurrent_requests_get_the_same_answers(run, engine, tiny_dir):
    """lm-eval's other path (aiohttp, ``num_concurrent`` requests in flight, what one uses with vLLM):
    the same numbers and texts, though the server batches the prompts differently."""
    _, first, _ = run
    tasks = ["engine_smoke_choice", "engine_smoke_gen"]
    _, out, after = evaluate(engine, tiny_dir, tasks, num_concurrent=3, batch_size=2)
    assert counter(after, "engine_requests_total", outcome="completed") == \
        ITEMS["engine_smoke_choice"] * CHOICES + ITEMS["engine_smoke_gen"]
    for task in tasks:
        got = [s["filtered_resps"] for s in out["samples"][task]]
        want = [s["filtered_resps"] for s in first["samples"][task]]
        if task == "engine_smoke_gen":
            assert got == want
        else:
            assert [[(pytest.approx(ll, abs=TOL), g) for ll, g in r] for r in want] == got
