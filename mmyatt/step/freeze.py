"""Freezing parameters by name: a leaf helper (it imports nothing of the engine or the
adapters), used by the builders for ``model.freeze`` and by the judges' training."""


def freeze_parameters(module, prefixes) -> int:
    """Stop training every parameter whose name starts with one of ``prefixes`` (a
    prefix matches whole dotted components: "proj_out" matches "proj_out.weight", not
    "proj_out2.weight"). Returns how many tensors were frozen; a prefix that matches
    nothing is an error naming ``model.freeze`` and a few valid names."""
    names = [n for n, _ in module.named_parameters()]
    frozen = 0
    for prefix in prefixes:
        hits = [n for n in names if n == prefix or n.startswith(prefix.rstrip(".") + ".")]
        if not hits:
            tops = sorted({n.split(".")[0] for n in names})
            raise ValueError(f"model.freeze: {prefix!r} matches no parameter; top-level: {tops}")
        for n, p in module.named_parameters():
            if n in hits and p.requires_grad:
                p.requires_grad_(False)
                frozen += 1
    return frozen
