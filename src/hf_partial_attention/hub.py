"""Hub packaging of every partial model (PartialBert and the other architectures): Auto-class registration,
``auto_map``, the model card on save and on push.

`register()` (run once by ``import hf_partial_attention``) registers the config and every head with
``AutoConfig`` / ``AutoModel*``, marks them for ``trust_remote_code`` (so ``save_pretrained`` copies the modeling
files next to the weights) and installs `save_pretrained` / `push_to_hub` as the models' hub hooks. Every push
path uploads this project's card: ``save_pretrained(push_to_hub=True)``, ``model.push_to_hub(repo_id)`` and
`training.PartialAttentionTrainer.push_to_hub`. The modeling files know nothing of this module, so it never
travels in the remote-code bundle.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

from huggingface_hub import CommitOperationAdd
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from transformers.utils.hub import hf_api

from . import model_card
from .configuration_partial_encoders import PARTIAL_CONFIG_CLASSES
from .modeling_partial import PartialModelMixin
from .modeling_partial_bert import PartialBertModel
from .modeling_partial_encoders import PARTIAL_MODEL_CLASSES
from .version import __version__

logger = logging.getLogger(__name__)

__all__ = ["AUTO_CLASSES", "AUTO_MAP", "AUTO_FACTORIES", "register", "auto_map_for", "merged_auto_map",
           "save_pretrained", "push_to_hub", "upload_folder"]

AUTO_FACTORIES = {
    "AutoModel": AutoModel,
    "AutoModelForMaskedLM": AutoModelForMaskedLM,
    "AutoModelForSequenceClassification": AutoModelForSequenceClassification,
    "AutoModelForTokenClassification": AutoModelForTokenClassification,
    "AutoModelForQuestionAnswering": AutoModelForQuestionAnswering,
}
# Every architecture: (config class, {Auto class name: model class}), one entry per architecture of the table.
_ALL = [(PARTIAL_CONFIG_CLASSES[t], classes) for t, classes in PARTIAL_MODEL_CLASSES.items()]
# PartialBert's: Auto class -> (factory, PartialBert class).
AUTO_CLASSES = {auto: (AUTO_FACTORIES[auto], klass)
                for auto, klass in PARTIAL_MODEL_CLASSES[PartialBertModel._partial_arch.model_type].items()}


def _auto_map(config_class, classes: dict[str, type]) -> dict[str, str]:
    # Only the saved class and its config get an auto_map entry by default; listing every head lets any AutoModel*
    # class load a folder with trust_remote_code=True.
    config_file = config_class.__module__.rsplit(".", 1)[-1]
    return {"AutoConfig": f"{config_file}.{config_class.__name__}",
            **{auto: f"{klass.__module__.rsplit('.', 1)[-1]}.{klass.__name__}" for auto, klass in classes.items()}}


AUTO_MAP = _auto_map(PartialBertModel.config_class, {auto: klass for auto, (_, klass) in AUTO_CLASSES.items()})


def register() -> None:
    """Register every architecture's config and heads with the Auto classes and for remote code; safe to call more
    than once."""
    for config_class, classes in _ALL:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()
        for name, model_class in classes.items():
            AUTO_FACTORIES[name].register(config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(name)
    PartialModelMixin._hub = _HubHooks


def auto_map_for(config) -> dict[str, str]:
    """The ``auto_map`` of a partial config's checkpoint: its config class and every head of its architecture."""
    for config_class, classes in _ALL:
        if config.model_type == config_class.model_type:
            return _auto_map(config_class, classes)
    raise ValueError(f"{config.model_type!r} is not a partial model type.")


def merged_auto_map(existing: dict[str, Any] | None, config=None) -> dict[str, Any]:
    """``existing`` entries (a user's own Auto classes) kept, this plugin's entries (of ``config``'s architecture;
    PartialBert's by default) added or updated."""
    return {**(existing or {}), **(AUTO_MAP if config is None else auto_map_for(config))}


def upload_folder(folder: str, repo_id: str, *, commit_message: str | None = None,
                  commit_description: str | None = None, private: bool | None = None, token=None,
                  revision: str | None = None, create_pr: bool = False):
    """Create the repo if needed and upload every file of ``folder`` in one commit (`HfApi.create_commit`)."""
    api = hf_api()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in sorted(names)]
    operations = [CommitOperationAdd(path_in_repo=os.path.relpath(path, folder).replace(os.sep, "/"),
                                     path_or_fileobj=path) for path in files]
    logger.info("Uploading %d files of %s to %s", len(operations), folder, repo_id)
    return api.create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message or "Upload model",
                             commit_description=commit_description, token=token, revision=revision,
                             create_pr=create_pr)


def save_pretrained(model, parent_save: Callable, save_directory, *args, write_model_card: bool | None = None,
                    push_to_hub: bool = False, **kwargs):
    """`PreTrainedModel.save_pretrained` (``parent_save``) with the complete ``auto_map`` and a model card.

    Args:
        write_model_card: ``None`` (default) writes a card only if the folder has no ``README.md`` yet;
            ``True`` replaces an existing one; ``False`` writes none. Only the main process writes it.
        push_to_hub: upload the folder afterwards, with this project's card (transformers' own push would write
            and upload its generic card first). ``repo_id``, ``commit_message``, ``create_pr``, ``private``,
            ``token`` and ``revision`` go to the upload.
    """
    hub = {key: kwargs.pop(key) for key in ("repo_id", "commit_message", "commit_description", "create_pr",
                                            "private", "revision") if key in kwargs}
    model.config.auto_map = merged_auto_map(getattr(model.config, "auto_map", None), model.config)
    model.config.partial_format_version = model.config.required_format_version  # format 2 readers read uniform k
    model.config.partial_plugin_version = __version__
    readme = os.path.join(os.fspath(save_directory), "README.md")
    had_readme = os.path.exists(readme)
    result = parent_save(save_directory, *args, **kwargs)
    is_main_process = kwargs.get("is_main_process", args[0] if args else True)
    if is_main_process and (write_model_card or (write_model_card is None and not had_readme)
                            or (push_to_hub and not had_readme)):
        model_card.write_model_card(model, save_directory, overwrite=True,
                                    repo_id=hub.get("repo_id") if push_to_hub else None)
    if push_to_hub and is_main_process:
        repo_id = hub.pop("repo_id", os.path.basename(os.path.normpath(os.fspath(save_directory))))
        return upload_folder(os.fspath(save_directory), repo_id, token=kwargs.get("token"), **hub)
    return result


def push_to_hub(model, repo_id: str, *, commit_message: str | None = None,
                commit_description: str | None = None, private: bool | None = None, token=None,
                revision: str | None = None, create_pr: bool = False, max_shard_size: int | str | None = "50GB",
                tags: list[str] | None = None, **card_kwargs):
    """`PreTrainedModel.push_to_hub` with this project's card (base model, tags, P and R, cost) instead of a
    template: the weights, config, modeling code and ``README.md`` go up in one commit. ``card_kwargs`` reach
    `model_card.build_model_card` (``eval_results``, ``datasets``, ``training_details``, ...)."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, max_shard_size=max_shard_size, write_model_card=False)
        card = model_card.build_model_card(model, repo_id=repo_id, tags=[*(model.model_tags or []), *(tags or [])],
                                           **card_kwargs)
        card.save(os.path.join(folder, "README.md"))
        return upload_folder(folder, repo_id, commit_message=commit_message, commit_description=commit_description,
                             private=private, token=token, revision=revision, create_pr=create_pr)


class _HubHooks:
    """What `PartialModelMixin.save_pretrained` / ``push_to_hub`` call once the plugin is imported."""

    save_pretrained = staticmethod(save_pretrained)
    push_to_hub = staticmethod(push_to_hub)
