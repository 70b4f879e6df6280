"""checkpoints: the offline checkpoints appear whole, even when several processes make them at once
(the tests and the notebooks run side by side)."""

import json
import multiprocessing

from safetensors import safe_open

from engine_lib.model.checkpoints import STDLIB_SMALL, _publish, _scratch, ensure_checkpoint


def _make(root: str) -> tuple[str, str]:
    return str(ensure_checkpoint("tiny", root=root)), str(ensure_checkpoint(STDLIB_SMALL, root=root))


def test_processes_making_the_same_checkpoints_at_once_all_get_whole_ones(tmp_path):
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        made = pool.map(_make, [str(tmp_path)] * 3)
    assert len(set(made)) == 1
    for folder in made[0]:
        json.loads((tmp_path / folder / "config.json").read_text())
        with safe_open(str(tmp_path / folder / "model.safetensors"), "pt") as f:
            assert len(list(f.keys())) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([STDLIB_SMALL, "tiny-seed0"])  # no leftovers


def test_publish_keeps_a_finished_copy_or_replaces_it_as_asked(tmp_path):
    out = tmp_path / "ckpt"
    first = _scratch(out)
    (first / "model.safetensors").write_text("first")
    assert _publish(first, out, replace=False) == out and not first.exists()
    second = _scratch(out)
    (second / "model.safetensors").write_text("second")
    _publish(second, out, replace=False)  # another process finished first: its copy stays
    assert (out / "model.safetensors").read_text() == "first" and not second.exists()
    third = _scratch(out)
    (third / "model.safetensors").write_text("third")
    _publish(third, out, replace=True)  # an explicit rewrite replaces it
    assert (out / "model.safetensors").read_text() == "third"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
