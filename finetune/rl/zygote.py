"""Runs inside a sandbox cell (finetune.rl.execute) as its first process, with the system's Python
and no import from the appliance: it forks every execution into namespaces of its own.

Starting a sandbox and an interpreter for each of thousands of short executions costs several
times what the program itself does; this process starts once per sandbox worker, with the harness
already imported, and for each execution the host asks for:
1. forks a child that takes new mount, PID, network, IPC and UTS namespaces (unshare) and forks
   again: that grandchild is process 1 of the new PID namespace, so every process the program
   starts ends with it;
2. the grandchild mounts a fresh tmpfs on /tmp, the execution's own task directory read-only on
   /task (the cell's other directories are unmounted), and a /proc of its PID namespace;
3. sets the execution's limits, drops every capability (bounding, inheritable, ambient), becomes a
   user id drawn for this execution alone and sets no-new-privileges;
4. opens the Python tests and hides them from the execution (/dev/null over the file);
5. forks the answers' template (finetune/rl/answer.py), which forks an answer for each test, and
   only then reads the tests: no answer's memory ever held them;
6. runs the harness, which runs the untrusted program in its children.

The zygote itself never runs untrusted code and no execution can see it (another PID namespace),
reach it (no descriptor of its socket), or outlive the namespace it was given. It reports each
execution's exit status on the socket; the verdict goes from the harness to the host on a pipe the
host gave for that execution alone.
"""

import array
import ctypes
import fcntl
import json
import os
import platform
import resource
import signal
import socket
import struct
import subprocess  # noqa: F401 (the harness imports it where it needs it: here once, not per execution)
import sys
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import answer  # type: ignore[import-not-found]  # bound next to this file in the cell
import harness  # type: ignore[import-not-found]

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 2
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 24, 38, 22
SECCOMP_MODE_FILTER = 2
CLONE_NEWUSER = 0x10000000
X32_SYSCALL_BIT = 0x40000000
# The architectures the filter knows: (AUDIT_ARCH_*, unshare, clone, clone3).
SYSCALLS = {"x86_64": (0xC000003E, 272, 56, 435), "aarch64": (0xC00000B7, 97, 220, 435)}
CAPABILITY_VERSION_3 = 0x20080522
STDOUT, STDERR, RESULT, TESTS = 1, 2, 3, 4
REQUEST_BYTES = 65536  # one request, one message (a SOCK_SEQPACKET socket)
SETUP_FAILED = 125


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def checked(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str, target: str, kind: str, flags: int, data: str = "") -> None:
    checked(libc.mount(source.encode(), target.encode(), kind.encode(), ctypes.c_ulong(flags),
                       data.encode() or None), f"mount {target}")


def serve(control: socket.socket) -> None:
    """One execution at a time, until the host closes the socket."""
    with open("/proc/sys/kernel/cap_last_cap") as handle:
        last_capability = int(handle.read())
    # Every request is received into this one buffer, parsed only in the execution's own processes,
    # and wiped after: no request (its entry point, its user) reaches a later execution's memory.
    request = bytearray(REQUEST_BYTES)
    descriptors = array.array("i")
    control.sendall(b"ready\n")
    while True:
        size, ancillary, _, _ = control.recvmsg_into([request], socket.CMSG_SPACE(3 * descriptors.itemsize))
        if size == 0:
            return
        fds = [fd for level, kind, data in ancillary if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
               for fd in array.array("i", data[:len(data) - len(data) % descriptors.itemsize])]
        status = in_child(partial(execution, control, memoryview(request)[:size], fds, last_capability), fds)
        request[:size] = bytes(size)
        control.sendall(f"{status}\n".encode())


def in_child(work: Callable[[], int], fds: list[int]) -> int:
    """`work` in a forked child (which ends with its result), this process keeping none of `fds`;
    the child's exit status, or 128 + the signal that ended it, as a shell reports it."""
    child = os.fork()
    if child == 0:
        status = SETUP_FAILED
        try:
            status = work()
        finally:
            os._exit(status)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def execution(control: socket.socket, message: memoryview, fds: list[int], last_capability: int) -> int:
    """In the middle process: the request read, new namespaces, then process 1 of the new PID
    namespace runs the execution; its exit status."""
    control.close()  # no execution holds the host's socket
    if len(fds) != 3:
        return SETUP_FAILED  # not the host's request: nowhere to say why
    try:
        request = json.loads(bytes(message))
        if not str(request["key"]).isdigit():
            raise ValueError("a request is a numeric key and three descriptors")
        checked(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
        mount("none", "/", "", MS_REC | MS_PRIVATE)  # nothing mounted here shows anywhere else
    except Exception as exc:
        return setup_failed(fds[2], f"its namespaces: {type(exc).__name__}: {exc}")
    return in_child(lambda: contained(request, fds, last_capability), fds)


def contained(request: dict[str, Any], fds: list[int], last_capability: int) -> int:
    """Process 1 of the execution's PID namespace: its mounts, limits and user, then the harness."""
    result, step = fds[2], "its mounts"
    try:
        limits = request["limits"]
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(limits['tmpfs'])},mode=1777")
        mount(f"/cells/{request['key']}", "/task", "", MS_BIND)
        mount("none", "/task", "", MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        checked(libc.umount2(b"/cells", MNT_DETACH), "umount /cells")
        step = "its tests"
        # An episode's task files are copied into its workspace whole: none is hidden there.
        tests = None if request.get("workspace") else hidden_tests()  # a descriptor, read later
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        step = "its signals"
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as process 1, nothing else reaches it from inside
        step = "its out-of-memory score"
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")  # out of memory, the cell's processes are killed after the execution's
        step = "its loopback device"
        loopback_up()
        step = "its descriptors"
        place_descriptors(fds, tests)
        result, step = RESULT, "its limits"
        processes = limits["processes"] + (tests is not None)  # the answers' template: one more than the program's
        for kind, value in ((resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"] + 1)),
                            (resource.RLIMIT_AS, limits["memory"]), (resource.RLIMIT_NPROC, processes),
                            (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_FSIZE, limits["tmpfs"]),
                            (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(kind, value if isinstance(value, tuple) else (value, value))
        step = "its user and privileges"
        drop_privileges(request.get("uid"), request.get("gid"), last_capability)
        os.chdir("/tmp")
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request["environment"].items()})
        os.environ["RESULT_FD"] = str(RESULT)
    except Exception as exc:
        return setup_failed(result, f"{step}: {type(exc).__name__}: {exc}")
    try:
        harness.not_dumpable()  # the template too: no answer may read or ptrace it
        forks = answer_template() if tests is not None else None
        harness.main(read_tests() if tests is not None else None, forks)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def hidden_tests() -> int | None:
    """The execution's Python tests, opened here, then hidden from it (/dev/null bound over the
    file, read-only): the harness judges with them, the answer never reads what it is judged by."""
    path = "/task/tests.py"
    if not os.path.exists(path):
        return None
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    mount("/dev/null", path, "", MS_BIND)
    mount("none", path, "", MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return descriptor


def answer_template() -> tuple[int, socket.socket]:
    """The answers' template forked (answer.serve_forks), holding neither the result descriptor
    nor the tests'; its pid, and the harness's end of the socket it forks answers on."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = os.fork()
    if child == 0:
        code = 1
        try:
            ours.close()
            os.close(RESULT)
            os.close(TESTS)
            answer.serve_forks(theirs)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    return child, ours


def read_tests() -> str:
    """The tests' source, from the descriptor opened before they were hidden (closed after)."""
    with open(TESTS, encoding="utf-8", closefd=True) as handle:
        return handle.read()


def loopback_up() -> None:
    """The execution's network namespace's loopback device up (its only device): programs that talk
    to themselves on 127.0.0.1 work, and reach nothing else."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        flags = struct.unpack("16sH14x", fcntl.ioctl(probe, siocgifflags, struct.pack("16sH14x", b"lo", 0)))[1]
        fcntl.ioctl(probe, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def place_descriptors(fds: list[int], tests: int | None) -> None:
    """stdin /dev/null, then stdout, stderr and the result pipe at 1-3, the tests' file (if any) at
    4, and no other descriptor."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in [*fds, *([] if tests is None else [tests])]]
    os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
    for fd, target in zip(high, (STDOUT, STDERR, RESULT, TESTS), strict=False):
        os.dup2(fd, target)
    os.closerange(RESULT + 1 if tests is None else TESTS + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def drop_privileges(uid: int | None, gid: int | None, last_capability: int) -> None:
    """No capability in any set, this execution's user and group (as root), no new privileges."""
    for capability in range(last_capability + 1):
        checked(libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0), "drop the bounding set")
    if uid is not None and gid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # clears the permitted, effective and ambient sets
    header, data = CapHeader(CAPABILITY_VERSION_3, 0), (CapData * 2)()
    checked(libc.capset(ctypes.byref(header), ctypes.byref(data)), "clear the capability sets")
    checked(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")
    no_user_namespaces()


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def no_user_namespaces() -> None:
    """A seccomp filter: no user namespace (in one, a process would hold capabilities again, and
    could mount a tmpfs past its size limit, say). unshare and clone with CLONE_NEWUSER fail with
    EPERM; clone3, whose flags a filter cannot read, with ENOSYS (the C library then uses clone);
    any other architecture's system calls are refused."""
    arch = SYSCALLS.get(platform.machine())
    if arch is None:
        raise OSError(f"no system call filter for {platform.machine()}")
    audit_arch, unshare, clone, clone3 = arch
    # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_JMP|JSET|K, BPF_RET
    load, jump_eq, jump_ge, jump_set, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    program = [
        (load, 0, 0, 4), (jump_eq, 1, 0, audit_arch), (ret, 0, 0, kill),  # seccomp_data.arch
        (load, 0, 0, 0),  # seccomp_data.nr
        (jump_ge, 0, 1, X32_SYSCALL_BIT), (ret, 0, 0, kill),  # x86-64's x32 calls: numbered apart
        (jump_eq, 0, 1, clone3), (ret, 0, 0, enosys),
        (jump_eq, 1, 0, unshare), (jump_eq, 0, 3, clone),
        (load, 0, 0, 16), (jump_set, 0, 1, CLONE_NEWUSER), (ret, 0, 0, eperm),  # args[0], its low 32 bits
        (ret, 0, 0, allow),
    ]
    filters = (SockFilter * len(program))(*(SockFilter(*instruction) for instruction in program))
    prog = SockFprog(len(program), filters)
    checked(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "the system call filter")


def setup_failed(result_fd: int, why: str) -> int:
    """The host's sandbox failed (not the program's doing): why, on the result pipe."""
    try:
        os.write(result_fd, json.dumps({"setup_failed": why[:400]}).encode())
    except OSError:
        pass
    return SETUP_FAILED


if __name__ == "__main__":
    serve(socket.socket(fileno=0))
