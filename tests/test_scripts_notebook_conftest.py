"""The notebook run's kernels use IPC sockets with a path of their own (scripts/notebook_conftest.py)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _plugin():
    spec = importlib.util.spec_from_file_location("notebook_conftest", ROOT / "scripts" / "notebook_conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_kernel_gets_its_own_ipc_sockets():
    plugin = _plugin()
    first, second = plugin.IpcKernelManager(), plugin.IpcKernelManager()
    assert first.transport == second.transport == "ipc"
    assert first.ip != second.ip and Path(first.ip).is_absolute()
    assert len(first.ip) + len("-5") < 100  # a unix socket path holds at most 107 bytes


def test_nbmake_runs_notebooks_through_it():
    plugin = _plugin()
    import nbmake.nb_run

    assert nbmake.nb_run.NotebookClient is plugin.IpcNotebookClient
    assert plugin.IpcNotebookClient(nb=None).kernel_manager_class is plugin.IpcKernelManager
    # and the book's notebook run installs it where pytest finds it
    assert 'cp scripts/notebook_conftest.py "$src/conftest.py"' in (ROOT / "scripts" / "build_book.sh").read_text()


def test_a_long_tmpdir_falls_back_to_a_short_socket_path(monkeypatch):
    plugin = _plugin()
    monkeypatch.setattr(plugin.tempfile, "gettempdir", lambda: "/" + "x" * 90)
    assert plugin.IpcKernelManager().ip.startswith("/tmp/nbmake-kernel-")
