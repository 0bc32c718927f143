def _first_shard(path: str) -> str:
    """The ``-00001-of-N`` file of the split set ``path`` belongs to (checked to exist)."""
    match = _SPLIT_RE.search(path)
    first = f"{path[: match.start()]}-00001-of-{match.group(2)}.gguf"
    if not os.path.isfile(first):
        raise FileNotFoundError(f"{path} is shard {int(match.group(1))} of a split GGUF, but its first shard {os.path.basename(first)} is not beside it")
    return first


def resolve_gguf_model_path(model_path: str) -> str:
    """The file to open for a GGUF model given as any shard of a split set or as a folder holding one model; any other path unchanged.

    A split set's metadata lives in its first shard, so a later shard resolves to it. A folder resolves to its one model (a single
    ``.gguf`` or one split set; ``*mmproj*`` vision towers beside it are ignored); a Hugging Face or FTW checkpoint folder is left alone."""
    if os.path.isfile(model_path):
        return _first_shard(model_path) if _SPLIT_RE.search(model_path) else model_path
    if not os.path.isdir(model_path) or any(
        os.path.isfile(os.path.join(model_path, f)) for f in ("config.json", FTW_METADATA_GGUF, "freetoken_weight.json")
    ):
        return model_path
    models: dict[str, str] = {}
    for name in sorted(os.listdir(model_path)):
        if not name.endswith(".gguf") or "mmproj" in name:
            continue
        match = _SPLIT_RE.search(name)
        models.setdefault(name[: match.start()] if match else name, os.path.join(model_path, name))
    if not models:
        return model_path
    if len(models) > 1:
        raise ValueError(f"{model_path} holds {len(models)} GGUF models ({', '.join(sorted(models))}); pass the file")
    only = next(iter(models.values()))
    return _first_shard(only) if _SPLIT_RE.search(only) else only
