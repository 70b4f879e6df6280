"""engine_lib/book/drive_cache.py: the model download and the reference outputs cached on a Drive folder,
here a temporary folder standing in for Google Drive."""

import pytest
from huggingface_hub import constants

from engine_lib.book.drive_cache import keep_on_drive
from engine_lib.model.hub import hub_cache_dir
from engine_lib.model.paths import default_cache_dir


@pytest.fixture
def drive(tmp_path, monkeypatch):
    # whatever keep_on_drive changes goes back after the test
    for name in ("HF_HUB_CACHE", "ENGINE_LIB_CACHE"):
        monkeypatch.setenv(name, "unset-by-the-test")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", constants.HF_HUB_CACHE)
    mounts = []

    def mount(root):
        mounts.append(root)
        (tmp_path / "drive" / "MyDrive").mkdir(parents=True)
    return tmp_path / "drive", mount, mounts


def test_mounts_once_and_points_both_caches_at_the_drive(drive):
    root, mount, mounts = drive
    caches = keep_on_drive(root=root, mount=mount)
    assert mounts == [str(root)]
    assert caches["hub"].is_dir() and caches["engine"].is_dir()
    assert caches["hub"].is_relative_to(root / "MyDrive") and caches["engine"].is_relative_to(root / "MyDrive")
    assert hub_cache_dir() == caches["hub"]  # where the engine's fetch_model downloads
    assert default_cache_dir() == caches["engine"]  # where ensure_ground_truth records
    again = keep_on_drive(root=root, mount=mount)  # a later chapter: Drive is mounted already
    assert again == caches and mounts == [str(root)]


def test_a_file_cached_by_one_chapter_is_found_by_the_next(drive):
    root, mount, _ = drive
    first = keep_on_drive(root=root, mount=mount)
    (first["engine"] / "ground_truth").mkdir()
    (first["engine"] / "ground_truth" / "ids.json").write_text("{}")
    later = keep_on_drive(root=root, mount=mount)
    assert (default_cache_dir() / "ground_truth" / "ids.json").read_text() == "{}"
    assert later["engine"] == first["engine"]


def test_outside_colab_it_says_why_it_cannot_mount(drive):
    root, _, _ = drive
    with pytest.raises(RuntimeError, match="only Colab"):
        keep_on_drive(root=root)
