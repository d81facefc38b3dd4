"""The two Table 1 studies, whose flags are dataclasses (`spec.StudyArguments`, `scratch_spec.ScratchArguments`)
parsed by transformers' `HfArgumentParser` (``python -m experiments table1 -h`` lists them)."""

__all__ = ["DATACLASS_STUDIES"]

# name -> (help, "module:arguments class", "module:run function", report file), modules under experiments
DATACLASS_STUDIES = {
    "table1": ("Table 1 on the real MiniLM: conversion loses, training with partial attention recovers? "
               "(resumable; make table1)", "table1.spec:StudyArguments", "table1.study:run_table1", "table1.md"),
    "table1-scratch": ("Table 1 as the paper ran it: BERT pretrained from scratch with P and R built in, beside "
                       "exact, P alone and the converted exact model (resumable; make table1-scratch)",
                       "table1.scratch_spec:ScratchArguments", "table1.scratch:run_table1_scratch", "table1.md"),
}
