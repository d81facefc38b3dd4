"""Runs several example-script runs in one process: ``python tests/run_examples.py plan.json``, where the plan is a
list of ``[script name, [argv...]]``. Under ``accelerate launch`` this pays the launch and the process group once for
many runs (`test_examples_encoders`)."""

import importlib.util
import json
import os
import sys

from accelerate import PartialState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(plan_path: str) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    for script, argv in plan:
        spec = importlib.util.spec_from_file_location(f"example_{script}", os.path.join(ROOT, "examples",
                                                                                          f"{script}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses in the script resolve their annotations through sys.modules
        spec.loader.exec_module(module)
        module.main(argv)
        # the main process writes the run's folder (model card, tokenizer) after training; the next run may read it
        PartialState().wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
