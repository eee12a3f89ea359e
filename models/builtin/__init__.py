"""The checkpoints shipped with mmyatt (``builtin:<name>`` in ``model.path`` and
``reward.judge.model``) and the code that made each of them. Which exist and where:
:mod:`mmyatt.config.builtin`."""

from mmyatt.config.builtin import builtin_names, builtin_path

__all__ = ["builtin_names", "builtin_path"]
