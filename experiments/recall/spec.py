"""The recall study's arguments and arms (``python -m experiments recall -h``).

An arm is ``exact`` or ``k<k>_<kind>[_last_exact][_greedy]``:

- kind ``fixed``: P and R built in from the first step, R fixed at its optimum for the task (fitted on the exact
  model's scores); ``trained``: the same R trained, at its own learning rate; ``p_only``: P alone, every other key
  masked, no R (sparse attention: the analogue of Zoology's sliding-window attention).
- every layer partial, or with ``_last_exact`` every layer but the last (the paper's design);
- P a band of the k nearest keys, or with ``_greedy`` the greedy's P on the exact model's covariance for the task.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from .tasks import ALL_TASKS, TASKS, RecallTask

__all__ = ["RecallArm", "RecallArguments", "parse_recall_arm", "COMMAND", "KINDS"]

COMMAND = "python -m experiments recall"
KINDS = ("fixed", "trained", "p_only")
_ARM = re.compile(r"^k(\d+)_(fixed|trained|p_only)(_last_exact)?(_greedy)?$")
# The verdicts' arms first: a run stopped early can already answer (e1)-(e3) at the smaller k.
DEFAULT_ARMS = ("exact,k8_trained,k8_p_only,k8_trained_last_exact,k8_p_only_last_exact,k8_fixed,k16_trained,"
                "k16_p_only,k8_trained_greedy,k8_p_only_greedy")
_NOT_RESULTS = ("output_dir", "run_dir", "threads", "progress", "report_only")


@dataclass(frozen=True)
class RecallArm:
    name: str
    k: int | None  # None: exact
    kind: str  # "exact" or one of KINDS
    last_exact: bool = False
    greedy: bool = False

    @property
    def reconstruction(self) -> str | None:
        """R's mode in training (None: no R)."""
        return {"fixed": "fixed", "trained": "per_layer"}.get(self.kind)


def parse_recall_arm(text: str) -> RecallArm:
    text = text.strip()
    if text == "exact":
        return RecallArm("exact", None, "exact")
    match = _ARM.match(text)
    if not match:
        raise ValueError(f"arm {text!r} is not 'exact' or k<k>_<kind>[_last_exact][_greedy] with kind one of "
                         f"{KINDS} (e.g. k8_trained_last_exact).")
    return RecallArm(text, int(match.group(1)), match.group(2), bool(match.group(3)), bool(match.group(4)))


@dataclass
class RecallArguments:
    """Every number of the study."""

    output_dir: str = field(default="results/recall", metadata={"help": "recall.md, recall.json, the figure"})
    run_dir: str = field(default="runs/recall", metadata={"help": "jobs and patterns (resumable)"})
    tasks: str = field(default=",".join(TASKS), metadata={"help": f"comma-separated, of {ALL_TASKS}"})
    arms: str = field(default=DEFAULT_ARMS, metadata={"help": "comma-separated arms (module docstring)"})
    seq_len: int = field(default=64, metadata={"help": "n (the issue's n = 128 at k = 16, 32 halved: same fractions)"})
    symbols: int = field(default=32, metadata={"help": "symbols of the tasks (MQAR: half keys, half values)"})
    pairs: int = field(default=4, metadata={"help": "MQAR's key-value pairs (queries) per window"})
    num_hidden_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 2
    intermediate_size: int = 256
    steps: str = field(default="mqar=1500,far_copy=600,near_copy=600,majority=1200,mqar_adjacent=4000",
                       metadata={"help": "training steps per task (task=steps, comma-separated)"})
    batch_size: int = 64
    learning_rates: str = field(default="1e-3,3e-3", metadata={"help": "each arm's rate is chosen among these on "
                                                                         "the validation split (seed 0)"})
    r_lr_ratios: str = field(default="1,0.1", metadata={"help": "trained arms: R's learning rate as these "
                                                                   "fractions of the body's, chosen with it"})
    seeds: str = field(default="0,1,2", metadata={"help": "seeds of each arm at its chosen rates (the first "
                                                             "also chooses them)"})
    validation_examples: int = 512
    test_examples: int = 2048
    covariance_examples: int = field(default=1024, metadata={"help": "training examples of the exact model's "
                                                                       "covariance (R's optimum, the greedy's P)"})
    solved_accuracy: float = field(default=0.99, metadata={"help": "exact must reach this on validation for a "
                                                                     "task's verdicts to count"})
    threads: int = 0
    progress: bool = True
    report_only: bool = field(default=False, metadata={"help": "write the report from the finished jobs, run none"})

    def __post_init__(self):
        self.arm_list()
        self.task_list()
        self.steps_of()
        for arm in self.arm_list()[1:]:
            if not 0 < arm.k < self.seq_len:
                raise ValueError(f"arm {arm.name}: k={arm.k} must be in (0, seq_len={self.seq_len}).")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                             f"{self.num_attention_heads}.")
        if not self.lr_list() or not self.seed_list() or not self.ratio_list():
            raise ValueError("learning_rates, r_lr_ratios and seeds each need at least one value.")

    def arm_list(self) -> list[RecallArm]:
        arms = [parse_recall_arm(a) for a in self.arms.split(",") if a.strip()]
        if not arms or arms[0].kind != "exact":
            raise ValueError(f"arms must start with 'exact' (the P, R and verdicts come from it), got {self.arms!r}.")
        if len({a.name for a in arms}) < len(arms):
            raise ValueError(f"arms lists an arm twice: {self.arms!r}.")
        return arms

    def task_list(self) -> list[RecallTask]:
        names = [t.strip() for t in self.tasks.split(",") if t.strip()]
        return [RecallTask(name, self.seq_len, self.symbols, self.pairs) for name in names]

    def steps_of(self) -> dict[str, int]:
        pairs = dict(item.split("=") for item in self.steps.split(",") if item.strip())
        steps = {name.strip(): int(value) for name, value in pairs.items()}
        missing = [t.name for t in self.task_list() if t.name not in steps]
        if missing or any(v < 1 for v in steps.values()):
            raise ValueError(f"steps={self.steps!r} must give every task ({missing} missing) a count >= 1.")
        return steps

    def lr_list(self) -> list[float]:
        return [float(x) for x in self.learning_rates.split(",") if x.strip()]

    def ratio_list(self) -> list[float]:
        return [float(x) for x in self.r_lr_ratios.split(",") if x.strip()]

    def seed_list(self) -> list[int]:
        return [int(s) for s in self.seeds.split(",") if s.strip()]

    def config_overrides(self, task: RecallTask) -> str:
        return (f"vocab_size={task.vocab_size},type_vocab_size={task.type_vocab_size},"
                f"num_hidden_layers={self.num_hidden_layers},hidden_size={self.hidden_size},"
                f"num_attention_heads={self.num_attention_heads},intermediate_size={self.intermediate_size},"
                f"max_position_embeddings={self.seq_len},hidden_dropout_prob=0.0,"
                f"attention_probs_dropout_prob=0.0,pad_token_id=0")

    def result_fields(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in _NOT_RESULTS}
