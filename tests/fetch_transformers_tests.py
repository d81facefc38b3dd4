"""Put transformers' common model tests (`ModelTesterMixin`) beside the installed transformers, for
`tests/test_transformers_common.py`.

transformers' wheel has no tests; its source distribution on PyPI ships ``tests/test_modeling_common.py``. This
script (run by ``make test``) downloads the sdist of the *installed* version with pip, extracts that file into
``<venv>/transformers_common/transformers_tests/`` and writes the two modules the sdist does not ship that it imports:
``exporters/test_export.py`` (``ExportTesterMixin``, a base of ``ModelTesterMixin``: the export tests, which the
project runs itself with dynamic shapes in `test_encoders.py` and `test_checkpoints.py`) and
``generation/test_utils.py`` (``GenerationTesterMixin``: generation, which an encoder does not do), each an empty
mixin. Nothing is written into the repository.

    python tests/fetch_transformers_tests.py [--dest DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

DEFAULT_DEST = Path(sys.prefix) / "transformers_common"
PACKAGE = "transformers_tests"
FILES = ("test_modeling_common.py",)
STUBS = {
    "exporters/test_export.py": '"""Stub: the sdist does not ship it; export is tested by the project itself."""\n\n\n'
                                "class ExportTesterMixin:\n    pass\n",
    "generation/test_utils.py": '"""Stub: the sdist does not ship it; encoders do not generate."""\n\n\n'
                                "class GenerationTesterMixin:\n    pass\n",
}


def stamp(dest: Path) -> Path:
    """The file naming the transformers version the extracted tests belong to."""
    return dest / PACKAGE / "TRANSFORMERS_VERSION"


def fetch(dest: Path = DEFAULT_DEST) -> Path:
    """Download and extract the common tests of the installed transformers into ``dest``; return the package dir."""
    wanted = version("transformers")
    package = dest / PACKAGE
    if stamp(dest).is_file() and stamp(dest).read_text().strip() == wanted:
        stamp(dest).touch()  # up to date: newer than the venv's stamp for make
        return package
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", f"transformers=={wanted}",
                        "--no-binary", ":all:", "--no-deps", "--dest", tmp], check=True)
        archives = list(Path(tmp).glob("transformers-*.tar.gz"))
        if len(archives) != 1:
            raise SystemExit(f"pip download transformers=={wanted} gave {archives}, not one sdist.")
        with tarfile.open(archives[0]) as tar:
            package.mkdir(parents=True, exist_ok=True)
            for name in FILES:
                member = tar.getmember(f"transformers-{wanted}/tests/{name}")
                (package / name).write_bytes(tar.extractfile(member).read())
    for relative, text in STUBS.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    (package / "__init__.py").touch()
    stamp(dest).write_text(wanted + "\n")
    return package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    print(f"transformers' common tests in {fetch(parser.parse_args().dest)}")


if __name__ == "__main__":
    main()
