"""A fork server for the test suite's peer processes: `python -m swarmnode ARGS` without paying the imports.

Every `swarmnode join`, `bootstrap`, `coordinate` or `api` process starts by importing torch, transformers
and hivemind: about 3 s of one core before it does anything, and the suite starts some hundreds of them on
two cores. The fork server is one process that imports all of that once and then forks a child for each
command. The child is the command as `python -m MODULE ARGS` would run it, with only the interpreter start
taken from the server: it gets its own session and process group, its output in its log file, `/dev/null`
as stdin, the caller's environment and working directory, `sys.argv` as `-m` sets it, the module run as
`__main__` through `runpy`, and on its way out Python's own exit steps (threads joined, `atexit`, an exit
status from `SystemExit`, a traceback and status 1 for an uncaught exception, death by SIGINT for an
uncaught KeyboardInterrupt). Signals are the child's: a node's SIGTERM shutdown, a SIGKILL to its group.

**Why forking is sound here.** The server has only its main Python thread when it forks, and no native
thread beyond the ones its imports left (checked before every fork): those are OpenBLAS's thread servers
(NumPy's and SciPy's), which OpenBLAS itself stops and restarts around a fork (`pthread_atfork`). The
server runs no tensor operation, so no OpenMP pool, lock or event loop is carried into a child. Random state is
not shared: `random` reseeds itself after a fork, and the child reseeds NumPy's and torch's global generators
from the OS. Nor are locks between processes: hivemind makes `multiprocessing` locks when it is imported
(`SHARED_LOCKS`), semaphores in shared memory that every child would otherwise share with every other, as
one program's processes do. A node killed while its DHT process held one (sending a result to its parent,
say) left it taken for every node forked after it, whose DHT processes then waited forever; each child
makes its own, as an `exec`ed process does, and the server refuses to fork when its imports made a
process-shared lock it does not know.

**When a child hangs.** A child dumps its threads' stacks into its log on SIGUSR1 (`faulthandler`), and so
do the Python processes it forks (hivemind's DHT process): `ForkedProcess.dump_stacks` asks them all, and a
local swarm does so before it reports a process that did not get ready in time.

**What stays an `exec`.** Only the plain command line uses the server (`LocalSwarm.command_line` not
overridden): a process in a network namespace or pinned to a core still starts with `exec`, and the CLI
tests that check what a user's shell sees run the real `python -m swarmnode`.

The protocol is one JSON object per line over a Unix socket: `spawn` answers the child's pid, `poll` its
exit status (None while it runs; the server reaps its children as they exit).
"""

from __future__ import annotations

import faulthandler
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

__all__ = ["ForkServer", "ForkedProcess", "install", "installed"]

#: What the server imports before it forks: everything a node, bootstrap, coordinator or API process would.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.conversion_mapping",
    "transformers.models.llama.modeling_llama",
    "hivemind",
    "swarmnode.cli",
    "swarmnode.cli.join",
    "swarmnode.cli.bootstrap",
    "swarmnode.cli.coordinate",
    "swarmnode.server.node",
    "swarmnode.server.handler",
    "swarmnode.coordinator.service",
    "swarmnode.client",
    "swarmnode.testing.faults",
)

#: Environment variables that libraries read when imported (Hugging Face caches and offline mode, thread pools,
#: allocators): a child whose values differ from the server's starts with `exec` instead.
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_",
                   "OPENBLAS_", "CUDA_", "XDG_CACHE_HOME", "PYTHON", "LD_")

#: The process-shared locks that PRELOAD makes at import (module, class, attribute), each made anew in a child.
SHARED_LOCKS = (
    ("hivemind.utils.mpfuture", "MPFuture", "_initialization_lock"),
    ("hivemind.utils.mpfuture", "MPFuture", "_update_lock"),
    ("hivemind.utils.mpfuture", "SharedBytes", "_lock"),
    ("hivemind.utils.asyncio", "_AsyncContextWrapper", "EXECUTOR_LOCK"),
)

#: How long a caller waits for the server to come up (it imports PRELOAD first), and for an answer.
START_TIMEOUT = 120.0
REPLY_TIMEOUT = 60.0


class ForkServerError(RuntimeError):
    """The fork server could not start or answer."""


class ForkServer:
    """The caller's side: start the server, ask it for children, stop it (with `close` or as a context)."""

    def __init__(self, env: dict[str, str] | None = None):
        """Nothing starts until the first request (a run that starts no process pays nothing)."""
        self._dir = Path(tempfile.mkdtemp(prefix="swarmnode-forkserver-"))
        self.path = self._dir / "socket"
        self._env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self._import_env = _import_time(self._env)
        self.popen: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._file: Any = None  # the socket's file: one JSON line per request, one per reply
        self._closed = False

    def _start(self) -> subprocess.Popen:
        with open(self._dir / "server.log", "wb") as log:
            return subprocess.Popen([sys.executable, "-m", "swarmnode.testing.forkserver", str(self.path)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env,
                                    start_new_session=True)

    def _connect(self) -> None:
        if self.popen is None:
            self.popen = self._start()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.popen.poll() is not None:
                raise ForkServerError(f"the fork server exited with {self.popen.returncode}:\n"
                                      f"{(self._dir / 'server.log').read_text(errors='replace')[-3000:]}")
            if self.path.exists():
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(str(self.path))
                except OSError:
                    sock.close()
                else:
                    self._sock, self._file = sock, sock.makefile("rwb")
                    return
            if time.monotonic() > deadline:
                raise ForkServerError(f"the fork server did not listen within {START_TIMEOUT:.0f} s")
            time.sleep(0.05)

    def request(self, message: dict) -> dict:
        with self._lock:
            if self._closed:
                raise ForkServerError("the fork server was closed")
            if self._file is None:
                self._connect()
            assert self._file is not None and self._sock is not None
            self._sock.settimeout(REPLY_TIMEOUT)
            try:
                self._file.write(json.dumps(message).encode() + b"\n")
                self._file.flush()
                line = self._file.readline()
            except OSError as error:  # a timeout included: the server is stuck or gone
                raise ForkServerError(f"the fork server did not answer: {error}") from error
        if not line:
            raise ForkServerError("the fork server closed the connection")
        reply = json.loads(line)
        if "error" in reply:
            raise ForkServerError(reply["error"])
        return reply

    def can_run(self, env: dict[str, str]) -> bool:
        """Whether a child with `env` sees what its imports saw (else it must start with `exec`)."""
        return self.alive() and _import_time(env) == self._import_env

    def spawn(self, module: str, args: list[str], *, log_path: Path, env: dict[str, str]) -> ForkedProcess:
        """Run `python -m module ARGS` as a forked child; its output to `log_path` (made empty first)."""
        Path(log_path).write_bytes(b"")
        reply = self.request({"op": "spawn", "module": module, "args": list(args), "log": str(log_path),
                              "env": dict(env), "cwd": os.getcwd()})
        return ForkedProcess(self, int(reply["pid"]), [sys.executable, "-m", module, *args])

    def alive(self) -> bool:
        """Not closed, and running (or not started yet)."""
        return not self._closed and (self.popen is None or self.popen.poll() is None)

    def close(self) -> None:
        """Stop the server (its children are their callers' to stop: they run on, in their own groups, and
        their `ForkedProcess` reads /proc from then on)."""
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
            if self._sock is not None:
                self._sock.close()
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ForkedProcess:
    """A child of the fork server, with the part of `subprocess.Popen` the swarm uses: `pid`, `args`,
    `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self.server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self.server.request({"op": "poll", "pid": self.pid})["returncode"]
            except (ForkServerError, OSError):
                self.returncode = None if psutil.pid_exists(self.pid) else -signal.SIGKILL  # the server is gone
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def dump_stacks(self, wait: float = 1.0) -> bool:
        """Ask the child, and the Python processes it forked, to write their threads' stacks into its log
        (SIGUSR1: `faulthandler`, registered in the child); give them `wait` s. Whether any was asked."""
        try:
            child = psutil.Process(self.pid)
            tree = [child, *child.children(recursive=True)]
            interpreter = child.exe()
        except psutil.Error:
            return False
        asked = False
        for process in tree:  # the child's forks share its interpreter (and handler); `p2pd` does not
            try:
                if process.exe() == interpreter:
                    process.send_signal(signal.SIGUSR1)
                    asked = True
            except psutil.Error:
                continue
        if asked:
            time.sleep(wait)
        return asked


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k != "PYTHONUNBUFFERED"}


_installed: ForkServer | None = None


def install(server: ForkServer | None) -> None:
    """Make `server` the one new `LocalSwarm`s start their processes with (None: `exec` again)."""
    global _installed
    _installed = server


def installed() -> ForkServer | None:
    """The fork server `install` set, while it runs."""
    return _installed if _installed is not None and _installed.alive() else None


# --- the server ---------------------------------------------------------------------------------------------
def _threads() -> int:
    """Threads of this process as the OS counts them (a library's native threads included)."""
    return len(os.listdir("/proc/self/task"))


def _exit_status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict, closing: list) -> None:
    """In the forked child: become the command and never return."""
    code = 1
    try:
        for thing in closing:  # the server's sockets: the child must not hold a connection open
            if isinstance(thing, socket.socket):
                os.close(thing.detach())  # not `close`, which waits for the makefile() objects' references
            else:
                thing.close()
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        os.chdir(request["cwd"])
        sys.path[0] = os.getcwd()  # as `python -m` sets it in the caller's directory (the server's was its own)
        os.environ.clear()
        os.environ.update(request["env"])
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks into the log (`dump_stacks`)
        _own_locks()
        _own_private_pages()
        _reseed()
        code = _run(request["module"], request["args"])
    except BaseException:  # a failure to become the command: said in its log
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _own_locks() -> None:
    """Make each of `SHARED_LOCKS` anew in this child: its own, shared only with the processes it forks itself,
    as in an `exec`ed process (hivemind's MPFuture backend starts afresh by itself in a process of a new pid)."""
    import importlib
    import multiprocessing

    for module, owner, name in SHARED_LOCKS:
        setattr(getattr(importlib.import_module(module), owner), name, multiprocessing.Lock())


def _unknown_shared_locks() -> list[str]:
    """The process-shared locks (`multiprocessing` semaphores) alive in this process other than `SHARED_LOCKS`,
    by type: what a child could not make its own."""
    import gc
    import importlib
    from multiprocessing.synchronize import SemLock

    known = {id(getattr(getattr(importlib.import_module(module), owner), name)) for module, owner, name in SHARED_LOCKS}
    return [f"{type(lock).__module__}.{type(lock).__qualname__} at {id(lock):#x}"
            for lock in gc.get_objects() if isinstance(lock, SemLock) and id(lock) not in known]


def _own_private_pages() -> None:
    """Copy every private page the child shares with the server, as if it had made it itself.

    Nodes measure what they hold as the proportional set size of their processes (`runtime.footprint`): a
    page shared by the server and N children counts 1/(N+1) in each, so a forked node would measure a
    fraction of the imports' memory that an `exec`ed one holds alone, and offer that much more to its KV
    cache. For each page of a private writable mapping that is present and not the child's alone
    (`/proc/self/pagemap`: bit 63 present, bit 56 mapped exclusively), writing a byte back to itself makes
    the kernel give the child its own copy; pages the server never touched stay untouched. The imports then
    cost a forked child what they cost an `exec`ed process, in memory and in PSS."""
    import ctypes

    import numpy

    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        for fields in regions:
            perms = fields[1]
            if perms[:2] != "rw" or perms[3] != "p" or (len(fields) > 5 and fields[5].startswith("[v")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            entries = numpy.frombuffer(os.pread(pagemap, (end - start) // page * 8, start // page * 8), numpy.uint64)
            shared = numpy.flatnonzero(((entries >> 63) & 1).astype(bool) & ~((entries >> 56) & 1).astype(bool))
            view = (ctypes.c_char * (end - start)).from_address(start)
            for index in shared.tolist():
                offset = index * page
                view[offset] = view[offset]
    finally:
        os.close(pagemap)


def _reseed() -> None:
    import numpy
    import torch

    numpy.random.seed()
    torch.seed()


def _run(module: str, args: list[str]) -> int:
    """Run `module` as `__main__` with `args`, then Python's exit steps; the exit status."""
    import atexit
    import runpy
    import traceback

    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does at exit: join threads
    atexit._run_exitfuncs()
    if code < 0:  # an uncaught KeyboardInterrupt ends the process by SIGINT, as Python's own exit does
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    native = _threads()  # the OpenBLAS servers (see the module's docstring)
    unknown = _unknown_shared_locks()

    def forkable() -> str | None:
        if unknown:
            return (f"the fork server's imports made process-shared locks that its children cannot make their own "
                    f"({', '.join(unknown)}): add them to SHARED_LOCKS")
        if threading.active_count() != 1 or _threads() > native:
            return (f"the fork server runs {threading.active_count()} Python threads and {_threads()} in all "
                    f"(after its imports: 1 and {native}): it will not fork")
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    files: dict[socket.socket, object] = {}
    exited: dict[int, int] = {}
    running: set[int] = set()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    def reap() -> None:
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            running.discard(pid)
            exited[pid] = _exit_status(status)

    def answer(request: dict, connection: socket.socket) -> dict:
        if request.get("op") == "spawn":
            if (problem := forkable()) is not None:
                return {"error": problem}
            pid = os.fork()
            if pid == 0:
                _child(request, [selector, listener, *files])
            running.add(pid)
            return {"pid": pid}
        if request.get("op") == "poll":
            reap()
            pid = int(request["pid"])
            return {"returncode": exited.get(pid) if pid not in running else None}
        return {"error": f"unknown request {request!r}"}

    owner = os.getppid()
    print(f"fork server ready on {path} ({len(sys.modules)} modules imported)", flush=True)
    while os.getppid() == owner:  # its caller gone (killed, say), the server ends too; children run on
        for key, _ in selector.select(timeout=0.5):
            if key.fileobj is listener:
                connection, _address = listener.accept()
                files[connection] = connection.makefile("rwb")
                selector.register(connection, selectors.EVENT_READ)
                continue
            connection = key.fileobj  # type: ignore[assignment]
            stream = files[connection]
            line = stream.readline()  # type: ignore[attr-defined]
            if not line:
                selector.unregister(connection)
                files.pop(connection)
                connection.close()
                continue
            try:
                reply = answer(json.loads(line), connection)
            except Exception as error:  # a bad request is answered, the server goes on
                reply = {"error": f"{type(error).__name__}: {error}"}
            stream.write(json.dumps(reply).encode() + b"\n")  # type: ignore[attr-defined]
            stream.flush()  # type: ignore[attr-defined]
        reap()


if __name__ == "__main__":
    serve(sys.argv[1])
