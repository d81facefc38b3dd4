"""A study's resumable state: one JSON result per finished job, written atomically, under ``run_dir``; and its
written results (`write_study`: the JSON and the Markdown every study leaves in its results folder).

A job counts as done when its JSON exists, so a killed run, started again with the same arguments, skips what
it finished and redoes only the job it was in. The arguments that shape results are stored beside the jobs and
checked on resume: continuing a run with different arguments would mix two studies in one table.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

__all__ = ["JobStore", "write_study"]

logger = logging.getLogger(__name__)


def write_study(folder: str | os.PathLike, stem: str, result: dict[str, Any], markdown: str) -> None:
    """``<folder>/<stem>.json`` (the result, indented) and ``<folder>/<stem>.md`` (its report); the folder is made."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(folder, f"{stem}.md"), "w") as f:
        f.write(markdown)


class JobStore:
    """Finished jobs of one study run (``<run_dir>/jobs/<name>.json``)."""

    def __init__(self, run_dir: str | os.PathLike, arguments: dict[str, Any]):
        self.run_dir = os.fspath(run_dir)
        self.jobs_dir = os.path.join(self.run_dir, "jobs")
        os.makedirs(self.jobs_dir, exist_ok=True)
        path = os.path.join(self.run_dir, "arguments.json")
        if os.path.exists(path):
            with open(path) as f:
                stored = json.load(f)
            changed = {k: (stored.get(k), v) for k, v in arguments.items() if stored.get(k) != v}
            if changed:
                raise ValueError(
                    f"run_dir={self.run_dir!r} holds a run with other arguments {changed} (stored, given); resume "
                    "it with the stored arguments, or start a new study with another --run_dir.")
        else:
            self._write(path, arguments)

    def _path(self, name: str) -> str:
        return os.path.join(self.jobs_dir, f"{name}.json")

    @staticmethod
    def _write(path: str, value: Any) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(tmp, path)  # atomic: a kill leaves either the old state or the finished job, never half a file

    def done(self, name: str) -> bool:
        return os.path.exists(self._path(name))

    def load(self, name: str) -> dict[str, Any]:
        with open(self._path(name)) as f:
            return json.load(f)

    def save(self, name: str, result: dict[str, Any]) -> dict[str, Any]:
        """Store job ``name``'s result (a name with ``/`` is a path under ``jobs/``)."""
        os.makedirs(os.path.dirname(self._path(name)), exist_ok=True)
        self._write(self._path(name), result)
        return result

    def run(self, name: str, fn, bar=None, study: str = "study") -> dict[str, Any]:
        """Job ``name``'s result: loaded when done, else ``fn()`` run, timed (``seconds``), saved and logged; ``bar``
        (tqdm) shows the job and counts it."""
        if not self.done(name):
            t0 = time.time()
            if bar is not None:
                bar.set_postfix_str(name)
            result = fn()
            result["seconds"] = time.time() - t0
            self.save(name, result)
            logger.info("%s job %s done in %.0f s", study, name, result["seconds"])
            if bar is not None:
                bar.update(1)
        return self.load(name)

    def model_dir(self, name: str) -> str:
        return os.path.join(self.run_dir, "models", name)
