"""Prompt and media manifests, installed as ``mmyatt.datasets``.

Each training rank reads, parses and decodes only its own shard of a manifest
(see :class:`ShardedManifest`); :mod:`mmyatt.datasets.synthetic` writes small demo tasks.
"""

if __name__ == "datasets":
    # This folder sits at the repository root, so ``import datasets`` run from the root would
    # find it before Hugging Face ``datasets``. Step aside: import whatever ``datasets`` the
    # rest of sys.path provides and leave that in sys.modules, which is what the importer's
    # ``import datasets`` statement returns once this module finishes executing.
    import importlib
    import os
    import sys

    def _is_repo_root(entry: str) -> bool:
        root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        return os.path.realpath(entry or os.curdir) == root  # "" on sys.path means the cwd

    del sys.modules["datasets"]
    _saved_path = list(sys.path)
    sys.path[:] = [entry for entry in _saved_path if not _is_repo_root(entry)]
    try:
        _other = importlib.import_module("datasets")
    except ModuleNotFoundError as error:
        if error.name != "datasets":
            raise  # the other package exists but one of its own imports failed
        # `from None`: the user asked for a package that is not installed, nothing more.
        raise ModuleNotFoundError("No module named 'datasets'", name="datasets") from None
    finally:
        sys.path[:] = _saved_path
    sys.modules["datasets"] = _other
else:
    from mmyatt.datasets.manifest import ManifestError, ShardedManifest
    from mmyatt.datasets.synthetic import arithmetic_records, write_arithmetic_task, write_jsonl

    __all__ = [
        "ManifestError",
        "ShardedManifest",
        "arithmetic_records",
        "write_arithmetic_task",
        "write_jsonl",
    ]
