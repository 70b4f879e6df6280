"""Resource contracts (issue 26): every kernel launch the engine makes, compiled for a T4 (sm_75) and an
H200 (sm_90) on this CPU with Triton's ptxas, fits the chip: no register spill, shared memory within
the block limit less a margin, and 16-bit attention dots on tensor cores from sm_80.

The compiles run once, in a subprocess without ``TRITON_INTERPRET`` (the interpreter replaces the
kernels at import), through ``python -m engine_lib.kernels.contracts``; the tests read its JSON.
``scripts/kernel_contracts.sh`` runs this file under the GPU machine's Triton 3.6.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from engine_lib.kernels.contracts import CHIPS, Resources  # noqa: E402

KERNELS = ["_partial_kernel", "_merge_kernel", "_int8_matvec_kernel", "_add_rmsnorm_kernel", "_rope_kv_write_kernel"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("contracts") / "contracts.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "engine_lib.kernels.contracts", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    if not out.exists():
        pytest.fail(f"the contract check crashed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}")
    result = json.loads(out.read_text())
    if "unavailable" in result:
        pytest.skip(result["unavailable"])
    print(run.stdout)  # the table, with -s
    return result


@pytest.mark.parametrize("chip", list(CHIPS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_launch_fits_the_chip(measured, chip, kernel):
    rows = [r for r in measured["engine"] if r["chip"] == chip and r["kernel"] == kernel]
    assert rows, f"no {kernel} launch was compiled for {chip}"
    bad = {r["config"]: Resources(**r).violations() for r in rows if Resources(**r).violations()}
    assert not bad, f"{kernel} on {CHIPS[chip].name} (triton {measured['triton']}): " + "; ".join(
        f"{config}: {', '.join(v)}" for config, v in bad.items())


def test_the_attention_covers_every_query_bucket_layout_and_dtype(measured):
    configs = {r["config"] for r in measured["engine"] if r["kernel"] == "_partial_kernel" and r["chip"] == "h200"}
    for needle in ("q_len 1 ", "(M=16)", "(M=32)", "(M=64)", "paged", "contiguous", "bfloat16", "float16", "float32",
                   "int8 cache"):
        assert any(needle in c for c in configs), needle


@pytest.mark.parametrize("chip", list(CHIPS))
def test_the_int8_cache_launches_are_checked(measured, chip):
    """Both kernels over an int8 cache compile to launches of their own (int8 tiles, the scales): every query
    bucket and both layouts for attention, both layouts for the write, in every dtype the chip runs."""
    rows = [r for r in measured["engine"] if r["chip"] == chip and "int8 cache" in r["config"]]
    dtypes = ["float16", "float32"] + (["bfloat16"] if CHIPS[chip].capability >= (8, 0) else [])
    attention = {(c.split(",")[0], c.split(" (M=")[1][:2], "paged" in c) for c in
                 (r["config"] for r in rows if r["kernel"] == "_partial_kernel")}
    assert attention == {(d, m, paged) for d in dtypes for m in ("16", "32", "64") for paged in (False, True)}
    writes = {r["config"] for r in rows if r["kernel"] == "_rope_kv_write_kernel"}
    assert writes == {f"{d}, {layout}, int8 cache" for d in dtypes for layout in ("contiguous", "paged")}


def test_the_old_t4_tiles_violate_the_contract(measured):
    """The tiles before issue 26 (64 keys a block on every GPU) spill on a T4: the contract must say so,
    or it could not catch the next such choice."""
    legacy = [Resources(**r) for r in measured["legacy"]]
    assert legacy, "the legacy tiles were not compiled"
    assert all(r.chip == "t4" for r in legacy)
    assert any(r.spill_bytes > 0 for r in legacy), [(r.config, r.registers, r.spill_bytes) for r in legacy]
    assert all(r.violations() for r in legacy if "float16" in r.config)


@pytest.mark.parametrize("chip", list(CHIPS))
def test_per_step_values_do_not_recompile(measured, chip):
    """kv_len, the number of chunks and the int8 rows change every step: one compile serves them all."""
    assert measured["variants"][chip] == {k: 1 for k in ("_partial_kernel", "_merge_kernel", "_int8_matvec_kernel")}


def test_the_contract_knows_the_engines_longest_kernel_query():
    from engine_lib.kernels import contracts
    from engine_lib.model.layers.attention import KERNEL_MAX_QUERY

    assert contracts.KERNEL_MAX_QUERY == KERNEL_MAX_QUERY
    assert contracts.query_lengths() == [1, 5, 8]  # 6 query heads a KV head: M = 16, 32, 64
