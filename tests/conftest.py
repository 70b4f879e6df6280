"""Shared fixtures: one tiny random checkpoint and its transformers reference per test session."""

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# quantized CPU models are not saved beside the test checkpoints (test_model_quantized_file turns it on): a test
# that watches the loader read the checkpoint must not find a saved model instead
os.environ.setdefault("ENGINE_LIB_QUANTIZED_FILE", "0")
if not torch.cuda.is_available():  # Triton decides at definition time: set before any kernel is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine_lib import Engine  # noqa: E402
from engine_lib.bench.reference import load_hf_model  # noqa: E402
from engine_lib.model.checkpoints import ensure_checkpoint  # noqa: E402
from engine_lib.model.tokenizer import seed_prompts  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return ensure_checkpoint("tiny", root=tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def fresh_kernel_rss() -> int:
    """The resident memory of a new Python process that has imported what a chapter imports first: the
    host baseline a notebook's kernel starts its memory budget from. A test worker's own is not that
    baseline: it holds whatever the test files before it left (cached engines, freed memory kept by malloc)."""
    import subprocess
    import sys

    code = ("import torch, transformers, engine_lib, matplotlib.pyplot; "
            "from engine_lib.book.host_budget import rss_bytes; print(rss_bytes())")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


@pytest.fixture
def budget(fresh_kernel_rss):
    """A chapter's memory budget (the T4 ledger and Colab's host memory), its host baseline that of a fresh
    kernel (``fresh_kernel_rss``) plus the stated CUDA allowance."""
    from engine_lib.book import memory_budget
    from engine_lib.book.host_budget import HostBudget

    b = memory_budget.MemoryBudget.start()
    b.host = HostBudget(baseline_bytes=fresh_kernel_rss + b.host.allowance)
    yield b
    memory_budget.ACTIVE = None


@pytest.fixture(scope="session")
def hf_tiny(tiny_dir):
    return load_hf_model(tiny_dir, torch.float32)


@pytest.fixture(scope="session")
def engines(tiny_dir):
    """Engine per (stage, dtype), built once: loading is cheap, compiling is not."""
    cache = {}

    def get(stage: str, dtype=torch.float32, **options):
        key = (stage, dtype, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = Engine.from_pretrained(tiny_dir, device="cpu", dtype=dtype, stage=stage, **options)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def engine(engines):
    """The server tests' engine (a module may define its own): the tiny checkpoint at the kv_cache rung."""
    return engines("kv_cache")


@pytest.fixture(scope="module")
def server(engine):
    """One OpenAI-compatible server per test module, on 127.0.0.1 (``tests/serve_helpers.py``)."""
    from serve_helpers import start

    srv = start(engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def prompts():
    return [p["input_ids"] for p in seed_prompts()]


def hf_greedy(hf_model, ids, max_new_tokens, **kwargs):
    """transformers' greedy ids for one prompt, generated part only, plain greedy unless told."""
    x = torch.tensor([ids], device=hf_model.device)
    kwargs.setdefault("repetition_penalty", 1.0)
    out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                            do_sample=False, temperature=None, top_p=None, top_k=None, **kwargs)
    return out[0, len(ids):].tolist()


def strip_stop(ids, stops=(151645, 151643)):
    """transformers keeps the stop token in its output; the engine does not."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i]
    return ids



def _readable_options() -> dict[str, set[str]]:
    """Every option of torch's dynamo and inductor configs that can still be read."""
    import torch._dynamo.config
    import torch._inductor.config
    configs = {"torch._dynamo.config": torch._dynamo.config, "torch._inductor.config": torch._inductor.config}
    with warnings.catch_warnings():  # reading a deprecated option warns
        warnings.simplefilter("ignore")
        return {name: {k for k in cfg.get_config_copy() if hasattr(cfg, k)} for name, cfg in configs.items()}


@pytest.fixture(autouse=True)
def _torch_config_options_survive_each_test():
    """A test that patches torch's config must use ``config.patch``: pytest's monkeypatch (>= 9.2)
    deletes the option on undo, and every later ``torch.compile`` in the process fails. Checked
    after every test, so the failure names the test that did it."""
    before = _readable_options()
    yield
    for name, options in _readable_options().items():
        lost = before[name] - options
        assert not lost, f"{name} lost {sorted(lost)}: patch it with {name}.patch(...), not monkeypatch"


# test modules (and test ids) that run our Triton kernels in the CPU interpreter; the contracts compile
# ahead of time instead, so they run under any Triton
INTERPRETED = ("test_kernels_",)
COMPILED_AHEAD = ("test_kernels_contracts",)


def pytest_collection_modifyitems(config, items):
    """Under a Triton whose interpreter cannot run our kernels (``kernels.interpreter_reason``: the GPU
    machine's 3.6 in the device-version rehearsal), those tests are skipped with the reason; the lock's
    Triton runs them all."""
    if torch.cuda.is_available():
        return
    from engine_lib.kernels import interpreter_reason

    reason = interpreter_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        name = item.module.__name__
        interpreted = name.startswith(INTERPRETED) and name not in COMPILED_AHEAD
        if interpreted or (name == "test_loop_cuda_contracts" and "triton" in item.name):
            item.add_marker(skip)
