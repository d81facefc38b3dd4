"""Converted checkpoints that sentence-transformers loads: the modules, pooling and lengths of the source.

A sentence-transformers model folder holds, beside the transformer's own files, ``modules.json`` (the module
list: the transformer at path ``""``, then pooling, normalisation, ...), ``sentence_bert_config.json``
(``max_seq_length``), ``config_sentence_transformers.json`` and one sub-folder per module with settings
(``1_Pooling/config.json``). `write_sentence_transformers_files` copies them next to a converted PartialBert
checkpoint with ``max_seq_length`` capped at n, so that ``SentenceTransformer(folder, trust_remote_code=True)``
loads it, with or without the plugin installed, and ``encode`` truncates to n instead of raising.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

logger = logging.getLogger(__name__)

__all__ = ["ST_FILES", "sentence_transformers_folder", "write_sentence_transformers_files"]

ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
_TRANSFORMER = "sentence_transformers.models.Transformer"


def sentence_transformers_folder(source, revision: str | None = None) -> str | None:
    """The local folder of ``source``'s sentence-transformers files, or None if it is not such a model.

    ``source`` is a local folder or a Hub id (its small sentence-transformers files are fetched, or read from the
    Hugging Face cache when offline).
    """
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = os.fspath(source)
    if os.path.isdir(path):
        return path if os.path.isfile(os.path.join(path, "modules.json")) else None
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(path, revision=revision, allow_patterns=[*ST_FILES, "*/config.json"])
    except Exception as err:  # noqa: BLE001 - not on the Hub / not cached: treated as a plain transformers model
        logger.info("No sentence-transformers files for %s (%s)", path, err)
        return None
    return folder if os.path.isfile(os.path.join(folder, "modules.json")) else None


def write_sentence_transformers_files(source_dir: str, out_dir: str, seq_len: int) -> dict:
    """Copy the module list and module settings of ``source_dir`` into ``out_dir``, ``max_seq_length`` ≤ ``seq_len``.

    Returns ``{"modules": [module types], "max_seq_length": int}``. Raises ValueError when the first module is not
    the transformer at the folder's root (the converted checkpoint must stand in for it).
    """
    with open(os.path.join(source_dir, "modules.json"), encoding="utf-8") as f:
        modules = json.load(f)
    if not modules or modules[0].get("path") != "" or not modules[0].get("type", "").endswith(".Transformer"):
        raise ValueError(f"{source_dir!r}: the first sentence-transformers module must be the {_TRANSFORMER} at path "
                         f"'' (the converted checkpoint replaces it), got {modules[:1]}.")
    os.makedirs(out_dir, exist_ok=True)
    shutil.copyfile(os.path.join(source_dir, "modules.json"), os.path.join(out_dir, "modules.json"))
    extra = os.path.join(source_dir, "config_sentence_transformers.json")
    if os.path.isfile(extra):
        shutil.copyfile(extra, os.path.join(out_dir, "config_sentence_transformers.json"))
    settings_path = os.path.join(source_dir, "sentence_bert_config.json")
    settings = {}
    if os.path.isfile(settings_path):
        with open(settings_path, encoding="utf-8") as f:
            settings = json.load(f)
    # P and R are defined for n positions: longer inputs must be truncated to n, not passed on to raise.
    settings["max_seq_length"] = min(int(settings.get("max_seq_length") or seq_len), seq_len)
    with open(os.path.join(out_dir, "sentence_bert_config.json"), "w", encoding="utf-8") as f:
        json.dump(settings, f, indent=2)
    for module in modules[1:]:
        src = os.path.join(source_dir, module.get("path", ""))
        if module.get("path") and os.path.isdir(src):
            shutil.copytree(src, os.path.join(out_dir, module["path"]), dirs_exist_ok=True)
    return {"modules": [m.get("type") for m in modules], "max_seq_length": settings["max_seq_length"]}
