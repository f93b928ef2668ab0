"""Two properties of the lent GPU machine, emulated on this CPU for every Python process started with this
folder on PYTHONPATH (Python imports `sitecustomize` at start-up), so that scripts/gpu_check.sh's dry run
meets here the failures it would meet there:

- T5FORGE_EMULATE_SYNC_DEBUG=1: `torch.cuda.set_sync_debug_mode` records the mode, and while it is "error"
  (2) the Tensor methods that read a value on the host (tests/host_reads.py HOST_READS) raise RuntimeError,
  as CUDA raises for a device tensor ("warn", 1: they warn). Installed when torch is imported, so that
  processes that never import it pay nothing. On this CPU every tensor is a host tensor, so the emulation
  is stricter than CUDA (which lets a read of a CPU tensor pass): the train step must read nothing.
- T5FORGE_EMULATE_GPU_IMAGE=1: the packages the GPU image lacks (scripts/gpu_preflight.py BROUGHT and
  OPTIONAL, plus antlr4) cannot be imported from site-packages; only from the folder T5FORGE_GPU_DEPS names
  (the stand-in for scripts/gpu_deps.sh's .gpu-deps), when it is on sys.path.

`install_sync_emulation(torch)` is also called directly by tests (it returns the function that undoes it)."""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MODES = {"default": 0, "warn": 1, "error": 2}


def install_sync_emulation(torch):
    """Replace set_sync_debug_mode / get_sync_debug_mode; while the mode is not 0 the host-read methods are
    wrapped (outside it torch's own methods serve: no cost, nothing for torch.compile to trace through).
    Returns undo()."""
    spec = importlib.util.spec_from_file_location("_t5forge_host_reads", TESTS / "host_reads.py")
    host_reads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_reads)
    state = {"mode": 0}
    saved = {name: getattr(torch.Tensor, name) for name in host_reads.HOST_READS}
    saved_cuda = (torch.cuda.set_sync_debug_mode, torch.cuda.get_sync_debug_mode)

    def guarded(name, original):
        def read(tensor, *args, **kwargs):
            if state["mode"] == 2:
                raise RuntimeError(f"called a synchronizing CUDA operation (emulated sync debug mode 'error': "
                                   f"Tensor.{name})")
            if state["mode"] == 1:
                warnings.warn(f"called a synchronizing CUDA operation (emulated: Tensor.{name})", stacklevel=2)
            return original(tensor, *args, **kwargs)
        read.__name__ = name
        return read

    def set_sync_debug_mode(debug_mode) -> None:
        state["mode"] = MODES[debug_mode] if isinstance(debug_mode, str) else int(debug_mode)
        for name, original in saved.items():
            setattr(torch.Tensor, name, guarded(name, original) if state["mode"] else original)

    torch.cuda.set_sync_debug_mode = set_sync_debug_mode
    torch.cuda.get_sync_debug_mode = lambda: state["mode"]

    def undo() -> None:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        torch.cuda.set_sync_debug_mode, torch.cuda.get_sync_debug_mode = saved_cuda

    return undo


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds `torch` as usual and installs the emulation once its module has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            install_sync_emulation(module)

        spec.loader.exec_module = exec_module
        return spec


def hidden_packages() -> list[str]:
    """BROUGHT and OPTIONAL of scripts/gpu_preflight.py (read, not imported: this runs before anything)."""
    tree = ast.parse((TESTS.parent / "scripts" / "gpu_preflight.py").read_text())
    names = ["antlr4"]
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in ("BROUGHT", "OPTIONAL"):
            names += ast.literal_eval(node.value)
    return names


class _GpuImageBlocker(importlib.abc.MetaPathFinder):
    """The packages the GPU image lacks come only from `deps` (None: from nowhere)."""

    def __init__(self, hidden: list[str], deps: str | None):
        self.hidden, self.deps = set(hidden), os.path.abspath(deps) if deps else None

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.hidden:
            return None  # submodules are looked up in their parent's __path__, which is already in deps
        allowed = [] if self.deps is None else [
            entry for entry in (path if path is not None else sys.path)
            if os.path.abspath(entry or ".") == self.deps or os.path.abspath(entry or ".").startswith(self.deps + os.sep)]
        spec = importlib.machinery.PathFinder.find_spec(fullname, allowed) if allowed else None
        if spec is None:
            raise ModuleNotFoundError(f"No module named {fullname!r} (emulated GPU image: bring it in .gpu-deps)",
                                      name=fullname)
        return spec


if os.environ.get("T5FORGE_EMULATE_SYNC_DEBUG") == "1":
    sys.meta_path.insert(0, _AfterTorchImport())
if os.environ.get("T5FORGE_EMULATE_GPU_IMAGE") == "1":
    sys.meta_path.insert(0, _GpuImageBlocker(hidden_packages(), os.environ.get("T5FORGE_GPU_DEPS")))
