"""The Table 1 studies' job runner (`JobRunner`): each job run once through a `JobStore` (a finished one is
loaded, never rerun) and counted on the study's one progress bar. The conversion study (`study`) and the
from-scratch one (`scratch`) both run their jobs through it.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from ..store import JobStore

__all__ = ["JobRunner"]


class JobRunner:
    """Runs a study's jobs in ``store`` (or another store, for a study run across several), showing them on a bar of
    ``total`` jobs of which ``done`` are finished already; ``study`` names the study on the bar and in the logs."""

    def __init__(self, store: JobStore, study: str, total: int, done: int, progress: bool):
        self.store, self.study = store, study
        self.bar = tqdm(total=total, desc=f"{study} jobs", disable=not progress)
        self.bar.update(done)

    def __call__(self, name: str, fn, where: JobStore | None = None) -> dict:
        """Job ``name``'s result: loaded when done, else ``fn()`` run and saved (`JobStore.run`)."""
        return (self.store if where is None else where).run(name, fn, self.bar, self.study)

    def close(self) -> None:
        self.bar.close()
