# The two commands: `make train` (set up, then train the tiny preset on the embedded corpus)
# and `make test` (set up, then run the whole suite on 8 virtual CPU devices). The tests compile many small
# programs: XLA's CPU backend optimisation is off (compile time, not numbers, is what tiny tests spend) and
# compiled programs are cached in .jax_cache across the processes of one run. Each worker takes whole files, the
# longest first (tests/conftest.py), so that they end together.
SHELL := /bin/bash
# The first interpreter that really runs and is >= 3.12 (a pyenv shim can exist and still fail).
PYTHON312 := $(shell for p in python3.12 python3.13 $$HOME/.pyenv/versions/3.12*/bin/python3.12 \
                 $$HOME/.pyenv/versions/3.13*/bin/python3.13 python3; do \
                 "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && { echo "$$p"; break; }; done)
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
comma := ,
EXTRAS := test$(if $(HAS_GPU),$(comma)gpu)
VENV := .venv
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: setup train test clean
setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "dropless needs Python >= 3.12: install it (e.g. 'pyenv install 3.12') and retry." >&2; exit 1; }
	@test -x $(VENV)/bin/python || $(PYTHON312) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	@rm -f $(VENV)/.installed-*; touch $@

train: setup
	$(VENV)/bin/dropless train $(ARGS)

# One worker per core: the suite is CPU-bound (compiling), and a worker more than the cores spends more CPU time
# on the same tests and makes the run longer.
# (At most 8: each worker holds its own compiled programs.)
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 8 ? n : 8 )))
test: setup
	XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 $$XLA_FLAGS" \
	  JAX_PLATFORMS=cpu JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	  $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs build src/*.egg-info .jax_cache .pytest_cache .import_linter_cache

# Device benchmarks (BENCHMARKS.md): each target measures on NVIDIA GPUs and writes its record, the commit and date
# inside, to benchmarks/results/<benchmark>[-<variant>]-<device>.json. Parsing them needs no GPU; running them
# does, one or two of one host as each says. They run in the project's environment (made by `make setup`); where
# dropless is importable already (a device machine without network), pass BENCH_PYTHON=python3.
ifeq ($(origin BENCH_PYTHON),undefined)
BENCH_PYTHON := $(VENV)/bin/python
BENCH_SETUP := setup
endif
BENCH_DEPS := bench-needs-gpu $(BENCH_SETUP)
DROPLESS := $(BENCH_PYTHON) -m dropless.cli
RESULTS := benchmarks/results
BENCH_SCRATCH := build/bench
# $(call merge_records,BENCHMARK,OUT,RECORDS): one record for a benchmark of several runs, each run's record in it
# under the name of its file ("run"), which says what a setting outside the config (an environment) was.
# (RESULTS may name a folder not made yet, e.g. on a device machine's output folder.)
merge_records = $(BENCH_PYTHON) -c 'import json, os, sys; name, out, *parts = sys.argv[1:]; \
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True); json.dump({"benchmark": name, "records": [{"run": \
  os.path.basename(p).removesuffix(".json"), **json.load(open(p))} for p in parts]}, open(out, "w"), indent=1)' \
  $(1) $(2) $(3)
# The device part of a record's name, read when a target runs: "NVIDIA H200" -> h200; two GPUs -> h200x2.
GPU = $(shell nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-' | sed 's/^nvidia-//')
DSV3_SHAPES := dsv3-gate-up-e32,dsv3-down-e32,dsv3-gate-up-e256,dsv3-down-e256
LADDER_RUNGS ?= 2,3,4,5,8,9
# label:VARIABLE=value+VARIABLE=value, one process each (NCCL reads its variables once per process).
COLLECTIVE_SETTINGS := default: channels16:NCCL_MIN_NCHANNELS=16 channels32:NCCL_MIN_NCHANNELS=32 \
  ctas32:NCCL_MIN_CTAS=32+NCCL_MAX_CTAS=32 proto_simple:NCCL_PROTO=Simple buffsize16M:NCCL_BUFFSIZE=16777216 \
  nthreads512:NCCL_NTHREADS=512 user_buffers:XLA_FLAGS=--xla_gpu_enable_nccl_user_buffers=true

BENCH_TARGETS := bench-gmm bench-gmm-fine bench-gmm-stream bench-gmm-sass bench-gmm-cluster-probe bench-stage-profile bench-permute tune-gmm-fine tune-gmm-stacked bench-gmm-backends bench-layer-check bench-step bench-step-batch1 bench-step-offload-flags \
  bench-step-4x4096 bench-ep bench-ep-strategies bench-ep-float8 bench-ep-nccl-channels32 bench-ep-xla-flags \
  bench-fp8-check bench-fp8-probe bench-fp8 bench-fp8-gmm bench-fp8-gmm-e256 bench-fp8-gmm-qwen3 bench-fp8-kernels \
  bench-fp8-step bench-fp8-step-profile bench-fp8-behind bench-fp8-wgrad bench-fp8-fresh-acc bench-fp8-layouts bench-fp8-product-check bench-fp8-master bench-fp8-accum bench-fp8-sass bench-fp8-parity bench-fp8-rowwise-compile bench-attention-vjp bench-attention-step bench-documents bench-router bench-router-selection bench-strategy-cost bench-collectives bench-plan
.PHONY: $(BENCH_TARGETS) bench-needs-gpu bench-speculative
bench-needs-gpu:
	@test -n "$(HAS_GPU)" || { echo "The bench-* targets measure on NVIDIA GPUs; nvidia-smi finds none here." >&2; exit 1; }

# 1 GPU: our grouped GEMM against XLA's dense GEMM of equal FLOPs, DeepSeek-V3's four shapes, Dirichlet groups.
# (Its chart stays in the scratch folder: the backend comparison's is the one kept.)
bench-gmm: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	$(DROPLESS) bench gmm --shapes $(DSV3_SHAPES) --skews dirichlet --backends dense,dropless --table \
	  --out $(RESULTS)/gmm-$(GPU).json --chart $(BENCH_SCRATCH)/gmm-$(GPU).png

# Any machine: speculative decoding with the MTP module against plain decoding, on a run trained with
# model.mtp_layers >= 1 (e.g. `make train ARGS="model.mtp_layers=1"`); RUN=its run directory.
bench-speculative: setup
	@test -n "$(RUN)" || { echo "pass RUN=<a run directory trained with model.mtp_layers >= 1>" >&2; exit 1; }
	$(VENV)/bin/python benchmarks/speculative.py --run-dir $(RUN) --out $(RESULTS)/speculative-$(or $(GPU),cpu).json

# 1 GPU: fine-grained experts (256, 128 and 512 experts) beside dense, and the whole expert stage (permute ->
# gate+up -> SwiGLU -> down -> unpermute) against its dense matmuls, for four models.
FINE_SHAPES := dsv3-gate-up-e256,dsv3-down-e256,qwen3-gate-up,qwen3-down,qwen3-next-gate-up,qwen3-next-down
bench-gmm-fine: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	$(DROPLESS) bench gmm --shapes $(FINE_SHAPES) --skews dirichlet --backends dense,dropless \
	  --stages dsv3-e32,dsv3-e256,qwen3-30b-a3b,qwen3-next --stage-paths default --table \
	  --out $(RESULTS)/gmm-fine-$(GPU).json --chart $(BENCH_SCRATCH)/gmm-fine-$(GPU).png

# 1 GPU: re-tune the fine-grained shapes' products over the warp-specialised tiles in every walk order and band
# width (writes the packaged src/dropless/gmm/configs.json; `make bench-gmm-fine` then measures what it chose).
# TUNE_PRODUCTS and TUNE_SHAPES split it over several calls; TUNE_KERNELS (both by default) the kernel families.
TUNE_PRODUCTS ?= fwd,dlhs,drhs
TUNE_SHAPES ?= $(FINE_SHAPES)
TUNE_KERNELS ?= dropless_ws,dropless_ws_stream,dropless_ws_stream_async
tune-gmm-fine: $(BENCH_DEPS)
	$(DROPLESS) tune-gmm --candidates fine --kernels $(TUNE_KERNELS) --products $(TUNE_PRODUCTS) \
	  --bench-shapes $(TUNE_SHAPES)

# 1 GPU: the stacked rows kernel (consumers one above the other, the second resting where a group's rows end)
# against the table's current choice, the fine-grained shapes' rows products in one run; writes the packaged table
# where it wins, every trial in gmm-stacked-<gpu>.json.
tune-gmm-stacked: $(BENCH_DEPS)
	$(DROPLESS) tune-gmm --candidates stacked --products fwd,dlhs --bench-shapes $(TUNE_SHAPES) \
	  --log $(RESULTS)/gmm-stacked-$(GPU).json $(if $(TUNE_OUT),--out $(TUNE_OUT))

# 1 GPU: the streaming warp-specialised kernels against the per-tile-pipeline ones, the same tiles in the same run,
# every product of the fine-grained shapes: tune-gmm's quick warp-specialised candidates of both families, each
# trial in gmm-stream-<gpu>.json (the table it picks stays in the scratch folder; `make tune-gmm-fine` writes the
# packaged one).
bench-gmm-stream: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	$(DROPLESS) tune-gmm --candidates quick --kernels dropless_ws,dropless_ws_stream,dropless_ws_stream_async --products $(TUNE_PRODUCTS) \
	  --bench-shapes $(TUNE_SHAPES) --out $(BENCH_SCRATCH)/gmm-stream-table.json --log $(RESULTS)/gmm-stream-$(GPU).json

# 1 GPU: what the warp-specialised kernels compile to (ptxas warnings, registers, the MMA waits in the PTX); the
# dumps and summary.json stay in the scratch folder.
bench-gmm-sass: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/gmm_sass.py --out-dir $(BENCH_SCRATCH)/gmm-sass

# 1 GPU: the fine-grained expert stages profiled, kernel by kernel: what runs outside the grouped GEMMs.
bench-stage-profile: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/stage_profile.py --out $(RESULTS)/stage-profile-$(GPU).json

# 1 GPU: the expert stage's row gathers (permutation, its backward, the expert boundaries), each form in one run.
bench-permute: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/permute_rows.py --out $(RESULTS)/permute-$(GPU).json

# 1 GPU: JAX's warp-specialised Hopper matmul with and without 2-CTA clusters that multicast a shared operand, beside
# our kernel at the same tile and XLA's dot, at the expert layers' dense shapes.
bench-gmm-cluster-probe: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/gmm_cluster_probe.py --out $(RESULTS)/gmm-cluster-probe-$(GPU).json

# 1 GPU: every grouped-GEMM backend, shape and group-size skew (the default `bench gmm`), with its chart.
bench-gmm-backends: $(BENCH_DEPS)
	$(DROPLESS) bench gmm --table --out $(RESULTS)/gmm-backends-$(GPU).json

# 1 GPU: the bf16 MoE layer through the GPU default against the float32 layer, beside plain JAX's bf16 error.
bench-layer-check: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/gpu_layer_check.py --out $(RESULTS)/layer-check-$(GPU).json

# 2 GPUs: the training-step ladder of deepseek-v3-proxy at 4 x 2,048 tokens per GPU (rung 1 does not fit this
# batch: bench-step-batch1 measures it; rungs 6-7: bench-step-offload-flags). Writes step-<device>.json and .png.
bench-step: $(BENCH_DEPS)
	$(DROPLESS) bench step --ladder --preset deepseek-v3-proxy --rungs $(LADDER_RUNGS) --steps 8 --seconds 2.5 \
	  --out $(RESULTS) train.batch_size=4 train.seq_len=2048

# 1 GPU: ladder rungs 1-5 at one sequence of 2,048 tokens, the batch at which rung 1 (jax.lax.ragged_dot) fits.
bench-step-batch1: $(BENCH_DEPS)
	rm -rf $(BENCH_SCRATCH)/step-batch1
	$(DROPLESS) bench step --ladder --preset deepseek-v3-proxy --rungs 1,2,3,4,5 --steps 5 --seconds 1.5 \
	  --out $(BENCH_SCRATCH)/step-batch1 train.batch_size=1 train.seq_len=2048
	mv $(BENCH_SCRATCH)/step-batch1/step-*.json $(RESULTS)/step-batch1-$(GPU).json

# 1 GPU: ladder rungs 4-7 (activation offloading, XLA scheduling flags) at 4 x 2,048 tokens.
bench-step-offload-flags: $(BENCH_DEPS)
	rm -rf $(BENCH_SCRATCH)/step-offload-flags
	$(DROPLESS) bench step --ladder --preset deepseek-v3-proxy --rungs 4,5,6,7 --steps 5 --seconds 1.5 \
	  --out $(BENCH_SCRATCH)/step-offload-flags train.batch_size=4 train.seq_len=2048
	mv $(BENCH_SCRATCH)/step-offload-flags/step-*.json $(RESULTS)/step-offload-flags-$(GPU).json

# 2 GPUs: the step at 4 x 4,096 tokens per GPU with rung 5's settings, on one GPU, then on two with expert
# parallelism (8 sequences), back to back.
bench-step-4x4096: $(BENCH_DEPS)
	CUDA_VISIBLE_DEVICES=0 $(DROPLESS) bench step --preset deepseek-v3-proxy --warmup 2 --steps 8 --seconds 2.5 \
	  --record $(RESULTS)/step-4x4096-$(GPU).json train.remat=none train.scan_layers=false train.batch_size=4
	$(DROPLESS) bench step --preset deepseek-v3-proxy --warmup 2 --steps 8 --seconds 2.5 \
	  --record $(RESULTS)/step-4x4096-$(GPU)x2.json train.remat=none train.scan_layers=false train.batch_size=8 \
	  parallel.expert=2

# 2 GPUs: the MoE layer with the default dispatch (auto), random routing, against the one-GPU layer.
bench-ep: $(BENCH_DEPS)
	$(DROPLESS) bench ep --iters 11 --strategies auto --skews random --table --out $(RESULTS)/ep-$(GPU)x2.json

# 2 GPUs: every dispatch strategy under random and skewed routing (the default `bench ep`).
bench-ep-strategies: $(BENCH_DEPS)
	$(DROPLESS) bench ep --iters 11 --table --out $(RESULTS)/ep-strategies-$(GPU)x2.json

# 2 GPUs: the default dispatch with FP8 rows on the link.
bench-ep-float8: $(BENCH_DEPS)
	$(DROPLESS) bench ep --iters 11 --strategies auto --skews random --table --out $(RESULTS)/ep-float8-$(GPU)x2.json \
	  moe.dispatch_dtype=float8

# 2 GPUs: the default dispatch with 32 NCCL channels (the fastest setting of bench-collectives).
bench-ep-nccl-channels32: $(BENCH_DEPS)
	NCCL_MIN_NCHANNELS=32 $(DROPLESS) bench ep --iters 11 --strategies auto --skews random --table \
	  --out $(RESULTS)/ep-nccl-channels32-$(GPU)x2.json

# 2 GPUs: the default dispatch compiled with each XLA scheduling candidate the layer has collectives for.
bench-ep-xla-flags: $(BENCH_DEPS)
	$(DROPLESS) bench ep --iters 5 --strategies auto --skews random --table \
	  --xla none,latency_hiding_scheduler,sol_latency_estimator,parallel_collective_overlap \
	  --out $(RESULTS)/ep-xla-flags-$(GPU)x2.json

# 2 GPUs: FP8 rows against bf16 rows: gradient error, and which collectives carry float8.
bench-fp8-check: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/fp8_dispatch_check.py --strategies allgather,ragged --out $(RESULTS)/fp8-check-$(GPU)x2.json

# 1 GPU: FP8 training (train.fp8): the grouped GEMM's FP8 paths beside bf16 and dense, the time of each quantization
# pass and kernel, the one-pass quantizer's settings, the e4m3 kernels alone, and the proxy's step in bf16 and each
# FP8 recipe (one record each). Its parts, for calls of limited length (one shape of the grouped-GEMM sweep compiles
# and times five paths in about 3 minutes on one H200): bench-fp8-gmm (DeepSeek-V3's 32-expert shapes),
# bench-fp8-gmm-e256, bench-fp8-gmm-qwen3 (Qwen3-30B-A3B), bench-fp8-kernels (quantizers, kernels, the expert
# stage), bench-fp8-step.
FP8_GMM = $(DROPLESS) bench gmm --skews dirichlet --backends dense,dense_fp8,dropless,fp8_rowwise,fp8_blockwise
bench-fp8: bench-fp8-gmm bench-fp8-gmm-e256 bench-fp8-gmm-qwen3 bench-fp8-kernels bench-fp8-step
bench-fp8-gmm: $(BENCH_DEPS)
	$(FP8_GMM) --shapes dsv3-gate-up-e32,dsv3-down-e32 --out $(RESULTS)/fp8-gmm-$(GPU).json
bench-fp8-gmm-e256: $(BENCH_DEPS)
	$(FP8_GMM) --shapes dsv3-gate-up-e256,dsv3-down-e256 --out $(RESULTS)/fp8-gmm-e256-$(GPU).json
bench-fp8-gmm-qwen3: $(BENCH_DEPS)
	$(FP8_GMM) --shapes qwen3-gate-up,qwen3-down --out $(RESULTS)/fp8-gmm-qwen3-$(GPU).json
bench-fp8-kernels: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	$(BENCH_PYTHON) benchmarks/fp8/breakdown.py --out $(RESULTS)/fp8-breakdown-$(GPU).json
	$(BENCH_PYTHON) benchmarks/fp8/pairs_sweep.py --out $(RESULTS)/fp8-pairs-$(GPU).json
	$(DROPLESS) bench gmm --shapes '' --stages dsv3-e32 --stage-paths default,fp8_blockwise,fp8_rowwise --table \
	  --out $(RESULTS)/fp8-stage-$(GPU).json
	DROPLESS_COMMIT=$$(git rev-parse --short HEAD) $(BENCH_PYTHON) benchmarks/fp8/kernel_check.py > $(RESULTS)/fp8-kernels-$(GPU).jsonl
# STEP_OVERRIDES (key=value ...) change all three runs, recorded in fp8-step-$(STEP_TAG)-<gpu>.json when STEP_TAG is
# set (e.g. STEP_OVERRIDES=model.attention_backend=cudnn STEP_TAG=cudnn).
STEP_OVERRIDES ?=
STEP_TAG ?=
FP8_STEP_RUN = fp8-step$(if $(STEP_TAG),-$(STEP_TAG))
bench-fp8-step: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	for recipe in off blockwise rowwise; do $(DROPLESS) bench step --preset deepseek-v3-proxy --steps 5 --seconds 6 \
	  --record $(BENCH_SCRATCH)/$(FP8_STEP_RUN)-$$recipe.json train.fp8=$$recipe $(STEP_OVERRIDES) || exit 1; done
	$(call merge_records,fp8-step,$(RESULTS)/$(FP8_STEP_RUN)-$(GPU).json,$(foreach r,off blockwise rowwise,$(BENCH_SCRATCH)/$(FP8_STEP_RUN)-$(r).json))

# 1 GPU: the proxy's training step profiled in bf16 and in blockwise FP8 (`dropless profile`, every HLO instruction
# listed), one record with both breakdowns; the traces stay in the scratch folder.
bench-fp8-step-profile: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	for recipe in off blockwise; do $(DROPLESS) profile --preset deepseek-v3-proxy --steps 2 --top 100000 \
	  --out $(BENCH_SCRATCH)/step-profile-$$recipe train.fp8=$$recipe || exit 1; done
	$(call merge_records,fp8-step-profiles,$(RESULTS)/fp8-step-profiles-$(GPU).json,$(foreach r,off blockwise,$(BENCH_SCRATCH)/step-profile-$(r)/breakdown.json))

# 1 GPU: tokamax's flash attention at DeepSeek-V3's MLA shape, the backward under each configuration of tokamax's
# autotuning space against its heuristic one.
bench-attention-vjp: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/attention_vjp_configs.py --out $(RESULTS)/attention-vjp-$(GPU).json

# 1 GPU: the proxy's step with each flash-attention backend (tokamax, cudnn), bf16 and blockwise FP8, in one run
# (attention-step-<gpu>.json).
bench-attention-step: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	for recipe in off blockwise; do for backend in tokamax cudnn; do $(DROPLESS) bench step --preset deepseek-v3-proxy \
	  --steps 5 --seconds 6 --record $(BENCH_SCRATCH)/attention-step-$$backend-$$recipe.json train.fp8=$$recipe \
	  model.attention_backend=$$backend || exit 1; done; done
	$(call merge_records,attention-step,$(RESULTS)/attention-step-$(GPU).json,$(foreach r,off blockwise,$(foreach b,tokamax cudnn,$(BENCH_SCRATCH)/attention-step-$(b)-$(r).json)))

# 1 GPU: the proxy's step without and with data.document_mask=true (tokamax's flash attention taking each query's
# document start), in one run (documents-step-<gpu>.json). The benchmark's batches are uniform random ids, in which
# the end-of-document id is rare: this is the option's cost where documents fill whole sequences.
bench-documents: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	for mask in false true; do $(DROPLESS) bench step --preset deepseek-v3-proxy --steps 5 --seconds 6 \
	  --record $(BENCH_SCRATCH)/documents-step-$$mask.json data.document_mask=$$mask || exit 1; done
	$(call merge_records,documents-step,$(RESULTS)/documents-step-$(GPU).json,$(foreach m,false true,$(BENCH_SCRATCH)/documents-step-$(m).json))

# 1 GPU: router balance, the proxy trained 300 steps on the embedded corpus at its own 8 x 4,096 tokens per step
# (ROUTER_BATCH=2: the records without a -batch suffix) with one variant of the router's settings (VARIANT=, default
# `defaults`, the preset as it is; `deepseek-v3`, DeepSeek-V3's router settings; the others are
# benchmarks/router_balance.py's VARIANTS, each a change to DeepSeek-V3's settings, e.g. seq-aux-1e-2, center-1,
# common-0.3, other-0.3): every layer's max/mean load per step and the
# held-out loss every 50 steps, in router-<variant>-batch<B>-<gpu>.json and .png. One variant takes about 6 minutes
# at 8 sequences per step, under 4 at 2.
# SEED=n (train.seed, default 0) repeats a variant from another initialisation, in router-<variant>-seed<n>-<gpu>.*:
# GPU training is not bit-reproducible, so a 1% held-out difference needs several runs per setting to resolve.
VARIANT ?= defaults
SEED ?= 0
# ROUTER_STEPS=n (default 300) trains longer, in router-<variant>-...-steps<n>-<gpu>.*.
ROUTER_BATCH ?= 8
ROUTER_STEPS ?= 300
ROUTER_RUN = $(VARIANT)$(if $(filter-out 0,$(SEED)),-seed$(SEED))$(if $(filter-out 2,$(ROUTER_BATCH)),-batch$(ROUTER_BATCH))$(if $(filter-out 300,$(ROUTER_STEPS)),-steps$(ROUTER_STEPS))
bench-router: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/router_balance.py --variant $(VARIANT) --steps $(ROUTER_STEPS) --eval-every 50 \
	  --out $(RESULTS)/router-$(ROUTER_RUN)-$(GPU).json --chart $(RESULTS)/router-$(ROUTER_RUN)-$(GPU).png \
	  train.batch_size=$(ROUTER_BATCH) train.eval_batches=2 train.seed=$(SEED)

# 1 GPU: the other sequences' projection for the expert selection only (benchmarks/router_selection_probe.py, a
# diagnostic), beside the option itself evaluated on the same training pass, the proxy 300 steps each (one call).
bench-router-selection: $(BENCH_DEPS)
	for weights in whole projected; do name=$$([ $$weights = whole ] && echo selection-only || echo train-eval); \
	  $(BENCH_PYTHON) benchmarks/router_selection_probe.py --weights $$weights --variant other-0.3 --steps 300 \
	  --eval-every 50 --out $(RESULTS)/router-other-0.3-$$name-$(GPU).json \
	  --chart $(RESULTS)/router-other-0.3-$$name-$(GPU).png train.batch_size=2 train.eval_batches=2 || exit 1; done

# 1 GPU: the blockwise e4m3 kernels' consumer layouts and tiles, per tile and streamed, each checked and timed at
# DeepSeek-V3's shapes with 32 and with 256 experts, beside bf16 and the whole FP8 product under each table (the
# choices behind fp8_mosaic.FP8_STACKS and FP8_STREAM).
bench-fp8-layouts: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/fp8/layouts.py --out $(RESULTS)/fp8-layouts-$(GPU).json
	$(BENCH_PYTHON) benchmarks/fp8/layouts.py --groups 256 --out $(RESULTS)/fp8-layouts-e256-$(GPU).json

# 1 GPU: the blockwise kernels with each K block's first wgmma issued with scale-d off (no zero-filled accumulator)
# against the same kernels with it, every product at DeepSeek-V3's widths, and Fp8Gmm forward+backward beside bf16;
# then the proxy's step in bf16, blockwise, and blockwise with fresh_acc on, one call.
bench-fp8-fresh-acc: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	$(BENCH_PYTHON) benchmarks/fp8/fresh_acc_probe.py --out $(RESULTS)/fp8-fresh-acc-$(GPU).json
	for run in "off False" "blockwise False" "blockwise True"; do set -- $$run; \
	  $(BENCH_PYTHON) -c "import sys; from dropless.gmm import fresh_acc; fresh_acc.ENABLED = $$2; \
	  from dropless.cli import main; sys.exit(main(sys.argv[1:]))" bench step --preset deepseek-v3-proxy --steps 5 \
	  --seconds 6 --record $(BENCH_SCRATCH)/fp8-fresh-acc-step-$$1-$$2.json train.fp8=$$1 || exit 1; done
	$(call merge_records,fp8-fresh-acc-step,$(RESULTS)/fp8-fresh-acc-step-$(GPU).json,$(foreach r,off-False blockwise-False blockwise-True,$(BENCH_SCRATCH)/fp8-fresh-acc-step-$(r).json))

# 1 GPU: the blockwise weight gradient written in bf16 (train.fp8_wgrad_dtype=bfloat16) against float32: its
# kernels' tiles and output dtypes at DeepSeek-V3's widths with 32 and 256 groups, then the proxy's step in bf16,
# blockwise and blockwise with bf16 weight gradients, one call.
bench-fp8-wgrad: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	$(BENCH_PYTHON) benchmarks/fp8/wgrad_tiles.py --groups 32 --out $(RESULTS)/fp8-wgrad-tiles-$(GPU).json
	$(BENCH_PYTHON) benchmarks/fp8/wgrad_tiles.py --groups 256 --out $(RESULTS)/fp8-wgrad-tiles-e256-$(GPU).json
	for run in "off float32" "blockwise float32" "blockwise bfloat16"; do set -- $$run; \
	  $(DROPLESS) bench step --preset deepseek-v3-proxy --steps 5 --seconds 6 \
	  --record $(BENCH_SCRATCH)/fp8-wgrad-$$1-$$2.json train.fp8=$$1 train.fp8_wgrad_dtype=$$2 || exit 1; done
	$(call merge_records,fp8-wgrad-step,$(RESULTS)/fp8-wgrad-step-$(GPU).json,$(foreach r,off-float32 blockwise-float32 blockwise-bfloat16,$(BENCH_SCRATCH)/fp8-wgrad-$(r).json))

# 1 GPU: the proxy's step with 4 microbatches (train.grad_accum_steps=4): bf16, blockwise with the weights' e4m3
# copies made once per step (train.fp8_cache_weights, the default) and blockwise quantizing in each microbatch, one
# call; ACCUM_OVERRIDES (key=value ...) change all three, e.g. finer experts.
ACCUM_OVERRIDES ?=
bench-fp8-accum: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	for run in "off" "blockwise" "blockwise train.fp8_cache_weights=false"; do set -- $$run; \
	  $(DROPLESS) bench step --preset deepseek-v3-proxy --steps 5 --seconds 6 \
	  --record $(BENCH_SCRATCH)/fp8-accum-$$1$${2:+-nocache}.json train.fp8=$$1 $$2 train.grad_accum_steps=4 \
	  $(ACCUM_OVERRIDES) || exit 1; done
	$(call merge_records,fp8-accum,$(RESULTS)/fp8-accum-$(GPU).json,$(foreach r,off blockwise blockwise-nocache,$(BENCH_SCRATCH)/fp8-accum-$(r).json))

# 1 GPU: each piece of the blockwise FP8 grouped GEMM (the one-pass quantizers, each e4m3 kernel) against the
# recipe's reference path at bench gmm's shapes (CHECK_SHAPES), one JSON line per piece.
CHECK_SHAPES ?= dsv3-down-e256,dsv3-gate-up-e256,dsv3-down-e32
bench-fp8-product-check: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/fp8/product_check.py --shapes $(CHECK_SHAPES) --out $(RESULTS)/fp8-product-check-$(GPU).json

# 1 GPU: the routed experts' grouped GEMM forward+backward from float32 master weights: bf16 (cast), blockwise cast
# to bf16 first, blockwise on the weights as stored; 32 groups.
bench-fp8-master: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/fp8/master_weights.py --out $(RESULTS)/fp8-master-$(GPU).json

# 1 GPU: a dense e4m3 matmul through XLA compiled and timed with XLA's GEMM autotuning on and off (one process each).
bench-fp8-rowwise-compile: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/fp8/rowwise_compile.py --timeout 120 --out $(RESULTS)/fp8-rowwise-compile-$(GPU).json

# 1 GPU: the blockwise kernels with each block's product promoted behind the next block's wgmma (`behind=True`):
# bits against the per-tile kernels at edge cases, ptxas's report and SASS of gmm_nt's 64x128 streamed kernel with
# and without it, and every variant of bench-fp8-layouts' kernels (32 groups) timed in one call.
bench-fp8-behind: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	$(BENCH_PYTHON) benchmarks/fp8/behind_check.py --out $(RESULTS)/fp8-behind-check-$(GPU).json
	$(BENCH_PYTHON) benchmarks/fp8/sass_dump.py --out-dir $(BENCH_SCRATCH)/fp8-behind-sass \
	  --kernels blockwise-stacked-128-streamed,blockwise-stacked-128-behind
	cp $(BENCH_SCRATCH)/fp8-behind-sass/summary.json $(RESULTS)/fp8-behind-sass-$(GPU).json
	$(BENCH_PYTHON) benchmarks/fp8/layouts.py --part kernels --out $(RESULTS)/fp8-layouts-behind-$(GPU).json

# 1 GPU: what the blockwise e4m3 kernels compile to (SASS, PTX, ptxas registers and spills, opcode counts) beside the
# unscaled kernel at the same tile; the dumps stay in the scratch folder, their summary is fp8-sass-<gpu>.json.
bench-fp8-sass: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/fp8/sass_dump.py --out-dir $(BENCH_SCRATCH)/fp8-sass
	cp $(BENCH_SCRATCH)/fp8-sass/summary.json $(RESULTS)/fp8-sass-$(GPU).json

# 1 GPU: loss parity, the proxy trained 300 steps with bf16 and each FP8 recipe (same data, seed, schedule).
# PARITY_MODES=rowwise PARITY_MERGE=--merge adds one recipe's run to the record already there (one device call each);
# a mode may name the weight gradient's dtype after a colon (blockwise:bfloat16: train.fp8_wgrad_dtype=bfloat16).
PARITY_MODES ?= off,blockwise,rowwise
PARITY_MERGE ?=
bench-fp8-parity: $(BENCH_DEPS)
	$(BENCH_PYTHON) benchmarks/fp8/loss_parity.py --modes $(PARITY_MODES) $(PARITY_MERGE) --steps 300 --eval-every 50 \
	  --out $(RESULTS)/fp8-parity-$(GPU).json --chart $(RESULTS)/fp8-parity-$(GPU).png \
	  train.batch_size=2 train.eval_batches=2

# 1 GPU: the FP8 probe (benchmarks/fp8/, not the product path): our kernel structure on e4m3 operands against our
# bf16 kernels, then XLA's FP8 GEMM per operand layout and XLA setting beside PyTorch's _scaled_mm; one record of both.
bench-fp8-probe: $(BENCH_DEPS)
	mkdir -p $(BENCH_SCRATCH)
	CUDA_VISIBLE_DEVICES=0 $(BENCH_PYTHON) benchmarks/fp8/grouped_gemm.py --out $(BENCH_SCRATCH)/fp8-probe-gmm.json
	CUDA_VISIBLE_DEVICES=0 $(BENCH_PYTHON) benchmarks/fp8/xla_layouts.py --out $(BENCH_SCRATCH)/fp8-probe-xla.json
	$(BENCH_PYTHON) -c 'import json, sys; gmm, xla, out = sys.argv[1:]; json.dump({"benchmark": "fp8-probe", \
	  "grouped_gemm": json.load(open(gmm)), "xla_layouts": json.load(open(xla))}, open(out, "w"), indent=1)' \
	  $(BENCH_SCRATCH)/fp8-probe-gmm.json $(BENCH_SCRATCH)/fp8-probe-xla.json $(RESULTS)/fp8-probe-$(GPU).json

# 1 GPU: what each dispatch strategy costs in compute, its collectives doing nothing on a one-GPU expert axis.
bench-strategy-cost: $(BENCH_DEPS)
	CUDA_VISIBLE_DEVICES=0 $(BENCH_PYTHON) benchmarks/strategy_cost.py --variants allgather,alltoall,allgather:float8,ragged \
	  --rounds 7 --out $(RESULTS)/strategy-cost-$(GPU).json

# 2 GPUs: the layer's collectives alone at its size under each NCCL/XLA setting, then through PyTorch's NCCL
# with a plain peer copy (where PyTorch is installed; it is no dependency of dropless).
bench-collectives: $(BENCH_DEPS)
	out=$(RESULTS)/collectives-$(GPU)x2.jsonl; rm -f $$out; set -e; \
	for setting in $(COLLECTIVE_SETTINGS); do vars=$${setting#*:}; \
	  env $${vars//+/ } $(BENCH_PYTHON) benchmarks/collectives.py --label $${setting%%:*} --out $$out; done; \
	if $(BENCH_PYTHON) -c 'import torch' 2>/dev/null; then \
	  $(BENCH_PYTHON) benchmarks/collectives_torch.py --out $$out; \
	  NCCL_MIN_NCHANNELS=32 $(BENCH_PYTHON) benchmarks/collectives_torch.py --out $$out; \
	else echo "PyTorch is not installed: its comparison is skipped."; fi

# 1 GPU: the plan's (`dropless plan`) predicted peak memory and step time against measured ones for 12
# configurations of deepseek-v3-proxy and a 4-layer qwen3-30b-a3b, each in a process of its own after one parallel
# compile into a persistent cache, in three parts of four (each under 10 minutes); prints the table of
# BENCHMARKS.md and docs/planning.md.
# PARTS=2/3 runs one part (under 10 minutes); the record keeps the other parts' rows.
PARTS ?= 1/3 2/3 3/3
bench-plan: $(BENCH_DEPS)
	for part in $(PARTS); do CUDA_VISIBLE_DEVICES=0 $(DROPLESS) bench plan-accuracy --part $$part \
	  --out $(RESULTS)/plan-accuracy-$(GPU).json || exit 1; done
