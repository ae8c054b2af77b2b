# rollout-server: every target sets itself up from a fresh machine.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 50051
MODEL ?= shapes
STUBS := clients/rollout/v1/rollout_pb2.py
STAMP := $(VENV)/.installed
BUF := npx --yes @bufbuild/buf@1.75.0
# The schema of the last release: `buf breaking` holds every later schema wire-compatible with it.
RELEASED_SCHEMA := protos/released/rollout-v1.binpb
# `make train-shapes`: AWM (the best of bench/shapes_rl.py) on the shapes task, 4 train prompts x 16
# samples per iteration, a KL to the EMA that the evals measure, the 256-image held-out eval every 40
# iterations; at most 14.5 minutes in all (--time-budget), its evals included.
SHAPES_TRAINING := --model shapes --prompt-set shapes --reward rollout_client.rewards.shapes:geneval_reward \
	--algorithm awm --lr 3e-4 --ema-decay 0.9 --awm-kl 1 --prompts 4 --group-size 16 --steps 8 --size 64 \
	--iterations 120 --eval-every 40 --eval-samples 4 --time-budget 870 --threads 2

.PHONY: serve test conformance demo train train-shapes pretrain-shapes proto lint bench clean

serve: $(STAMP) $(STUBS)
	$(VENV)/bin/rollout-server serve --model $(MODEL) --host $(HOST) --port $(PORT)

# Test files run on this many worker processes (pytest-xdist), a file's tests on one worker together, so
# its module fixtures (servers) start once, the slowest files first (tests/conftest.py); 1 runs them
# in this process. 2 on 2 cores: with most servers forked and trainers in process, a third worker is no
# faster (docs/testing.md has the runs).
TEST_WORKERS ?= 2

test: $(STAMP) $(STUBS)
	$(PY) -m pytest -q $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The conformance kit's reference replayer over every recorded case (conformance/README.md): the presets
# the vectors were recorded from are built into the preset cache first (once).
conformance: $(STAMP) $(STUBS)
	$(PY) -c "from pathlib import Path; from rollout_server.presets import resolve_model; \
		[resolve_model(f.stem) for f in sorted(Path('conformance/vectors').glob('*.safetensors'))]"
	OMP_NUM_THREADS=1 $(PY) conformance/replay.py

demo: $(STAMP) $(STUBS)
	$(PY) examples/demo.py --out demo-output

train: $(STAMP) $(STUBS)
	$(PY) examples/train_grpo.py --out train-output

# FlowGRPO on the shapes task: the GenEval-style reward, evaluated on the held-out eval prompts.
train-shapes: $(STAMP) $(STUBS)
	$(PY) examples/train_grpo.py --out train-output-shapes $(SHAPES_TRAINING)

# Pretrains the shapes preset's VAE and transformer (resumable); the weights land in pretrain-shapes-output/weights.
pretrain-shapes: $(STAMP) $(STUBS)
	$(PY) examples/pretrain_shapes.py --out pretrain-shapes-output --resume

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I protos --python_out=clients --pyi_out=clients \
		--grpc_python_out=clients protos/rollout/v1/rollout.proto

$(STUBS): protos/rollout/v1/rollout.proto $(STAMP)
	$(MAKE) proto

lint: $(STAMP) $(STUBS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(BUF) lint
	$(BUF) breaking --against $(RELEASED_SCHEMA)

bench: $(STAMP) $(STUBS)
	$(PY) bench/stream_overhead.py
	$(PY) bench/sp_scaling.py
	$(PY) bench/weight_update.py
	$(PY) bench/prompt_cache.py
	$(PY) bench/concurrency.py
	$(PY) bench/train_modes.py
	$(PY) bench/replicas.py
	$(PY) bench/tree.py
	$(PY) bench/solvers.py

# torch goes first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==26.3 setuptools==80.9.0
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,train,ray,tensorboard]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) demo-output train-output train-output-shapes eval-shapes-output pretrain-shapes-output clients/rollout/v1/*_pb2*.py* .pytest_cache .ruff_cache
