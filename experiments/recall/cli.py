"""The recall study, whose flags are a dataclass (`spec.RecallArguments`) parsed by transformers'
`HfArgumentParser` (``python -m experiments recall -h`` lists them)."""

__all__ = ["DATACLASS_STUDIES"]

# name -> (help, "module:arguments class", "module:run function", report file), modules under experiments
DATACLASS_STUDIES = {
    "recall": ("What R earns: exact, P + R and P alone trained from scratch on associative recall, far and near "
               "copy and a global task (resumable; make recall)", "recall.spec:RecallArguments",
               "recall.run:run_recall", "recall.md"),
}
