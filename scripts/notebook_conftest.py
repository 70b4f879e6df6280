"""pytest plugin for the notebook run: scripts/build_book.sh copies it to executed/conftest.py.

Each notebook's kernel talks to pytest over IPC sockets (files), not TCP ports. Over TCP the
kernel manager picks five free ports, releases them and hands them to the kernel; with two
notebooks at a time another process (the other worker's kernel, or a chapter's server on
port 0) can take one in between, and the kernel dies at start ("Kernel died before replying to
kernel_info": CI, 2026-12-04, chapter 03). A socket path made unique per kernel cannot collide.
"""

import os
import tempfile
import uuid

import nbclient
import nbmake.nb_run
from jupyter_client import AsyncKernelManager
from traitlets import CaselessStrEnum, Type, default


class IpcKernelManager(AsyncKernelManager):
    transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)

    @default("ip")
    def _unique_socket_prefix(self) -> str:
        # the kernel's sockets are <prefix>-1 ... -5; jupyter's default prefix is relative to the
        # working directory, which both workers share
        # a unix socket's path holds at most 107 bytes: a long TMPDIR falls back to /tmp
        base = tempfile.gettempdir() if len(tempfile.gettempdir()) <= 60 else "/tmp"
        return os.path.join(base, f"nbmake-kernel-{uuid.uuid4().hex}")


class IpcNotebookClient(nbclient.NotebookClient):
    kernel_manager_class = Type(IpcKernelManager, klass=AsyncKernelManager, config=True)


nbmake.nb_run.NotebookClient = IpcNotebookClient
