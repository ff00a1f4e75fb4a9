"""The training sandbox: a job's trainer sees only what the job needs.

With `finetune.sandbox = "bubblewrap"` (the default) the trainer runs
- as the dedicated unprivileged user `appliance-train` (when the appliance runs as root; anyone
  else's trainer runs as that user, who owns nothing of the appliance's anyway),
- in mount, PID, IPC, UTS and network namespaces of its own (bubblewrap): the system's programs
  and libraries and the Python environment read-only, the base model and the job's dataset
  read-only, the job's directory as the only writable place besides a private /tmp, and no
  network but a loopback device of its own (torchrun's processes meet on it);
- with a clean environment (no secret, no engine key, no APPLIANCE_* variable), offline;
- under limits on memory (`finetune.sandbox_memory_gib`) and processes, threads included
  (`finetune.sandbox_max_processes`, counted for its user).

The state dir's secrets, the supervisor's socket, the audit log and other jobs' data are simply
not there. `finetune.sandbox = "none"` runs the trainer as a plain child (for hosts without
bubblewrap; say so to whoever audits the host).
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import sys
from pathlib import Path

from appliance.errors import ApplianceError
from appliance.programs import OFFLINE_ENVIRONMENT
from appliance.settings import FinetuneSettings

SANDBOX_USER = "appliance-train"
# What a trainer runs with, in the sandbox or not. On a CPU host it shares cores with the engines:
# OpenMP's threads spin at each barrier by default, waiting on a sibling that another process holds
# off its core. Passive waiting made the gate's generation next to a busy process 2.25 x faster and
# 15 % slower alone (bench/cpu_contention.py); on a GPU host the trainer's CPU threads hardly work.
TRAINER_ENVIRONMENT = {**OFFLINE_ENVIRONMENT, "OMP_WAIT_POLICY": "PASSIVE"}
PROJECT = Path(__file__).resolve().parent.parent  # an editable install imports from here
TMPFS = (Path("/tmp"), Path("/dev/shm"))  # the trainer's scratch space, private, gone when it ends
# The system's programs and libraries; hosts and nsswitch.conf so that torchrun's processes find
# each other at "localhost" on the sandbox's own loopback device.
SYSTEM_READ_ONLY = ("/usr", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
                    "/etc/localtime", "/etc/hosts", "/etc/nsswitch.conf")


class SandboxError(ApplianceError):
    """The sandbox cannot be set up on this host."""


# As root, bubblewrap sets a sandbox up with root's access to what it binds; the command then
# becomes an unprivileged user inside. Anyone else gets a user namespace (bubblewrap's
# unprivileged mode: --unshare-all).
ROOT_NAMESPACES = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]


def system_user(name: str, what: str, otherwise: str = "") -> pwd.struct_passwd:
    """A sandbox's account (bootstrap.sh and install.sh create them as root)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise SandboxError(f"the {what}'s user {name!r} does not exist",
                           hint=f"useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "
                                f"{name} (as root){otherwise}") from None


def sandbox_user() -> pwd.struct_passwd:
    """The trainer's own user."""
    return system_user(SANDBOX_USER, "training sandbox", ", or set finetune.sandbox = \"none\"")


def sandbox_tools(what: str, otherwise: str = "") -> tuple[str, str]:
    """bubblewrap and prlimit, or why they are needed."""
    bwrap, prlimit = bubblewrap(what, otherwise), shutil.which("prlimit")
    if prlimit is None:
        raise SandboxError(f"the {what} needs `prlimit` (util-linux)", hint=f"apt-get install util-linux{otherwise}")
    return bwrap, prlimit


def bubblewrap(what: str, otherwise: str = "") -> str:
    """bubblewrap, or why it is needed."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError(f"the {what} needs bubblewrap (`bwrap`)", hint=f"apt-get install bubblewrap{otherwise}")
    return bwrap


def become(uid: int, gid: int) -> list[str]:
    """Run the rest as `uid`/`gid` with no groups, capabilities or new privileges."""
    return ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs"]


def system_mounts() -> list[str]:
    """/bin, /lib, /lib64 and /sbin as the host has them (links into /usr where it is merged)."""
    mounts = []
    for top in ("/bin", "/lib", "/lib64", "/sbin"):
        if Path(top).is_symlink():
            mounts += ["--symlink", os.readlink(top), top]
        elif Path(top).exists():
            mounts += ["--ro-bind", top, top]
    return mounts


def prepare(workdir: Path, inputs: list[Path], readable: list[Path]) -> None:
    """As root: give the job's directory to the sandbox's user (it writes its checkpoints there);
    its inputs stay the appliance's, shown to that user's group alone (0640, mounted read-only);
    and let the group read `readable` (the base model, a policy to resume: files are often saved
    0600, and the appliance makes its own so: the group gets read access, nothing else changes and
    the owner stays)."""
    if os.geteuid() != 0:
        return
    user = sandbox_user()
    for path in [workdir, *workdir.rglob("*")]:
        if path not in inputs and not path.is_symlink():
            os.chown(path, user.pw_uid, user.pw_gid)
    for path in inputs:
        os.chown(path, 0, user.pw_gid)
        path.chmod(0o640)
    for tree in readable:
        try:
            for path in [tree, *tree.rglob("*")]:
                mode = path.stat().st_mode
                if path.is_symlink() or mode & stat.S_IROTH and (not path.is_dir() or mode & stat.S_IXOTH):
                    continue  # anyone may read it already
                os.chown(path, -1, user.pw_gid)
                path.chmod(mode | stat.S_IRGRP | (stat.S_IXGRP if path.is_dir() else 0))
        except OSError as exc:
            raise SandboxError(f"cannot let the training sandbox read {tree}: {exc}",
                               hint=f"make {tree} readable by group {SANDBOX_USER}") from exc


def sandboxed(command: list[str], settings: FinetuneSettings, *, workdir: Path, inputs: list[Path],
              readable: list[Path], network: str | None = None) -> list[str]:
    """`command` wrapped to run in the sandbox: `workdir` writable, `inputs` (files in it) and
    `readable` (the base model) read-only, nothing else of the appliance's. `network`: the named
    network namespace of a job over several hosts (finetune.training_network), which reaches the
    job's other hosts' ranks only, in place of a network of the sandbox's own (root only)."""
    if settings.sandbox == "none":
        return command if network is None else ["ip", "netns", "exec", network, *command]
    bwrap, prlimit = sandbox_tools("training sandbox", ", or set finetune.sandbox = \"none\"")
    namespaces, drop, enter = ["--unshare-all"], [], []
    if network is not None and os.geteuid() != 0:
        raise SandboxError("a training job over several hosts needs the appliance to run as root (its network "
                           "namespace and rules)")
    if os.geteuid() == 0:
        user = sandbox_user()
        namespaces, drop = ROOT_NAMESPACES, become(user.pw_uid, user.pw_gid)
        if network is not None:
            namespaces, enter = [n for n in namespaces if n != "--unshare-net"], ["ip", "netns", "exec", network]
    limits = [prlimit, f"--data={sandbox_memory_bytes(settings)}", f"--nproc={settings.sandbox_max_processes}", "--"]
    mounts = [*namespaces, "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev",
              *(arg for path in TMPFS for arg in ("--perms", "1777", "--tmpfs", str(path)))]
    mounts += system_mounts()
    bound = [Path(p) for p in [*SYSTEM_READ_ONLY, *_python_paths(), *map(str, readable)] if Path(p).exists()]
    for path in bound:
        mounts += ["--ro-bind", str(path), str(path)]
    for device in sorted(Path("/dev").glob("nvidia*")):  # the GPUs, where there are any
        mounts += ["--dev-bind", str(device), str(device)]
    mounts += ["--bind", str(workdir), str(workdir)]
    for path in inputs:
        mounts += ["--ro-bind", str(path), str(path)]
    # bubblewrap makes the directories leading to each mount with the host's modes (a 0700 state
    # dir included): opened up so that the trainer's user can walk to what it is shown.
    for parent in leading_directories([*bound, workdir]):
        mounts += ["--chmod", "0755", str(parent)]
    environment = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
                   **TRAINER_ENVIRONMENT}
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        environment["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    setenv = [arg for name, value in sorted(environment.items()) for arg in ("--setenv", name, value)]
    return [*enter, *limits, bwrap, *mounts, "--chdir", str(workdir), "--clearenv", *setenv, "--", *drop, *command]


def sandbox_memory_bytes(settings: FinetuneSettings) -> int:
    """The data memory each sandboxed process may use (prlimit's, per process)."""
    return int((settings.sandbox_memory_gib or _ram_gib() * 0.8) * 2**30)


def leading_directories(mounted: list[Path]) -> list[Path]:
    """The directories above each mount point that bubblewrap creates (not mounts themselves, nor
    inside one), shallowest first."""
    def inside_a_mount(path: Path) -> bool:
        return any(path == m or path.is_relative_to(m) for m in mounted)

    parents = {parent for path in mounted for parent in path.parents} - {Path("/"), *TMPFS}
    return sorted((p for p in parents if not inside_a_mount(p)), key=lambda p: len(p.parts))


def _python_paths() -> list[str]:
    """What this Python needs to run: its installation, the virtual environment, and the project
    an editable install imports from."""
    paths = {sys.base_prefix, sys.prefix, str(PROJECT)}
    return sorted(p for p in paths if not p.startswith("/usr/") and p != "/usr")


def _ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
