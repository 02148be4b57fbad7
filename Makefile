# duet: the two entry points a newcomer needs, plus helpers.
#   make up    fetch the model if missing, build release, start the all-in-one server
#   make test  install what the suite needs, fetch the model, run every test (Rust suite,
#              then the offline checks of deploy/: Helm chart, dashboard, alert rules, then
#              the CUDA build without a GPU: scripts/check-cuda-build.sh)
#   make build-cuda  the binary with --device cuda (toolkit from PyPI wheels); prints its path
#   make image       the container image, from a Debian base built here (nothing pulled)
#   make image-cuda  its CUDA variant (the cuda build plus CUDA's libraries from PyPI wheels)
#   make cluster-up / cluster-down   a compose cluster: etcd, router, 2 prefill, 2 decode

SHELL := /bin/bash
MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf
PROMPT ?= Explain in one sentence why the sky is blue.
CARGO ?= cargo

.PHONY: up test model deps build build-cuda image image-cuda cluster-up cluster-down lint fmt bench-engine clean-results

up: deps model
	$(CARGO) build --release -p duet
	@echo
	@echo "starting duet up (router + 1 prefill + 1 decode worker, one process); Ctrl-C stops it"
	@echo "call it from another shell:  ./target/release/duet generate --chat --prompt '$(PROMPT)'"
	@echo "or over HTTP (OpenAI API):    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' -d '{\"messages\":[{\"role\":\"user\",\"content\":\"$(PROMPT)\"}]}'"
	@echo
	./target/release/duet up --model $(MODEL)

# scripts/test-rust.sh builds what `cargo test --workspace` builds (features rdma and
# fault-injection: see there) and runs the test binaries two at a time, the longest first
# (every one runs; the failed are listed at the end).
test: deps model
	CARGO=$(CARGO) ./scripts/test-rust.sh
	./scripts/check-deploy.sh
	./scripts/check-cuda-build.sh

build-cuda:
	./scripts/build-cuda.sh

image:
	./scripts/build-image.sh

image-cuda: model
	./scripts/build-cuda-image.sh

cluster-up: model
	./scripts/cluster-up.sh

cluster-down:
	./scripts/cluster-down.sh

model:
	./scripts/fetch-model.sh
	./scripts/fetch-gemma.sh

deps:
	./scripts/install-test-deps.sh

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --workspace --all-targets --features duet/rdma,duet/fault-injection,duet-kv-transfer/nccl -- -D warnings
	./scripts/unused-deps.sh
	./scripts/audit.sh

fmt:
	$(CARGO) fmt --all

# Engine throughput beside llama.cpp on the same GGUF and threads (not CI).
bench-engine: model
	./scripts/bench-engine.sh
