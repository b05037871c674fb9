"""Make SGLang 0.5.23's scheduler-side modules importable on a CPU-only machine (tests only).

The CPU environment (scripts/ci-sglang-env.sh) has SGLang installed without its CUDA dependencies
and without torchvision: the PyPI torchvision wheel is a CUDA build that breaks on the CPU torch.
`sglang.srt.managers.schedule_batch` imports `sglang.srt.configs`, whose multimodal model configs
(InternVL, DeepSeek-OCR, ...) do `import torchvision.transforms` at module level, though nothing on
the scheduler, schedule-policy or radix-cache paths calls into torchvision.

`prepare()`:
1. asks transformers whether torchvision is available *before* anything could provide it (the
   answer, False, is cached by transformers' `lru_cache`), so transformers keeps treating
   torchvision as unavailable;
2. installs an import hook that serves `torchvision` and its submodules as inert stand-ins: any
   attribute exists (so `from torchvision.transforms import InterpolationMode` succeeds), but
   *calling* anything raises, so a test that strayed into image code would fail loudly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = "torchvision"


class _Inert:
    """Stands for any torchvision object: attribute access works, calls raise."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> "_Inert":
        if item.startswith("__"):
            raise AttributeError(item)
        return _Inert(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} called: torchvision is not installed in the CPU SGLang test environment")

    def __repr__(self) -> str:
        return f"<inert {self._name}>"


class _InertModule(types.ModuleType):
    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Inert(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == STUBBED or fullname.startswith(STUBBED + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


_installed = False


def prepare() -> None:
    """Idempotent; call before importing any `sglang.srt` module. Raises RuntimeError when a real
    torchvision is installed or transformers already considers it available."""
    global _installed
    if _installed:
        return
    from transformers.utils import import_utils

    if STUBBED in sys.modules or import_utils.is_torchvision_available():
        raise RuntimeError("torchvision is installed or already imported; the CPU SGLang environment must not have it")
    sys.meta_path.append(_Finder())
    _installed = True
