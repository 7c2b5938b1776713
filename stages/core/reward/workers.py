"""The worker processes that run math-verify's symbolic comparison under a hard time limit.

Hard time limit
---------------
math-verify's own timeouts use ``signal.alarm``, which fails outside the main thread, so they are
switched off and the symbolic comparison runs in a persistent worker process (a fresh
interpreter that imports math-verify once). The caller waits at most ``timeout_s`` per
comparison; a worker that overruns is killed and replaced, and the answer is graded incorrect
with ``error="timeout"``. Numeric and string comparisons never leave the calling process. Workers
are shared by all threads (at most one comparison per CPU at once), their address space and CPU
time are capped, and their verdicts are cached. Starting a worker (~2 s: first use, and in the
background after each timeout) is not counted in ``timeout_s``. Work in the calling process is
linear in the response length (only the last box is scanned, answers over MAX_ANSWER_CHARS are
refused, no pattern can backtrack). Nothing about a response makes grading raise; only bad
arguments do (an unknown answer type, batch lengths that differ).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

from stages.core.reward.equivalence import full_verdict

WORKER_START_TIMEOUT_S = 120.0  # a worker imports sympy (~2 s); not counted in timeout_s
WORKER_MEMORY_HEADROOM = 2 << 30  # bytes of address space a worker may add to its start size
_CACHE_SIZE = 100_000


class _WorkerDied(RuntimeError):
    pass


class _Overrun(Exception):
    """A comparison passed its deadline (not TimeoutError: that is an OSError)."""


def _limit_resources() -> None:
    """Cap the worker's address space, so a runaway evaluation fails with MemoryError."""
    with contextlib.suppress(ImportError, OSError, StopIteration, ValueError):
        import resource

        with open("/proc/self/status") as status:
            size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize"))
        limit = size_kb * 1024 + WORKER_MEMORY_HEADROOM
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard == resource.RLIM_INFINITY or hard > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _limit_cpu(timeout_s: float) -> None:
    """Let the kernel end this job (SIGXCPU) a second after its deadline.

    The parent kills an overrunning worker itself; this second limit matters when the parent
    died mid-job, so an orphaned worker cannot spin on a huge power forever. Only the soft limit
    moves, because an unprivileged process cannot raise a hard limit again.
    """
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        used = usage.ru_utime + usage.ru_stime
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = int(used + timeout_s) + 2
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _worker_main(fd: int) -> None:
    """Serve (job, answer, gold, rel_tol, timeout_s) requests on socket `fd` until it closes."""
    from multiprocessing.connection import Connection

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout disabled" warnings
    import math_verify  # noqa: F401 - imported before "ready", so no deadline pays for it

    _limit_resources()
    conn = Connection(fd)
    conn.send("ready")
    while True:
        try:
            job, answer, gold, rel_tol, timeout_s = conn.recv()
        except (EOFError, OSError):
            return
        _limit_cpu(timeout_s)
        try:
            verdict, error = full_verdict(answer, gold, rel_tol)
        except BaseException as exc:  # MemoryError, RecursionError, sympy internals
            verdict, error = False, f"worker_error: {type(exc).__name__}: {exc}"[:200]
        conn.send((job, bool(verdict), error))


_WORKER_COMMAND = (
    "import sys; from stages.core.reward.workers import _worker_main; _worker_main(int(sys.argv[1]))"
)


class _Worker:
    """One worker process and its socket.

    A fresh interpreter (``python -c``), not a multiprocessing child: fork is unsafe in the
    threaded callers we serve, and spawn/forkserver re-import the caller's ``__main__``, which
    re-runs any unguarded script. Starting does not block; :meth:`compare` waits for the worker
    to be ready before its deadline starts.
    """

    def __init__(self) -> None:
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_COMMAND, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # the socket is the only channel
                env=env,
                start_new_session=True,  # Ctrl-C goes to the caller, which stops its workers
            )
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._ready = False
        self._job = 0

    def _wait_ready(self) -> None:
        if not self._conn.poll(WORKER_START_TIMEOUT_S):
            raise _WorkerDied(f"not ready within {WORKER_START_TIMEOUT_S:.0f} s")
        self._conn.recv()
        self._ready = True

    def compare(self, answer: str, gold: str, rel_tol: float, timeout_s: float):
        """(verdict, error) from the worker; raises _Overrun or _WorkerDied."""
        try:
            if not self._ready:
                self._wait_ready()
            self._job += 1
            self._conn.send((self._job, answer, gold, rel_tol, timeout_s))
            deadline = time.monotonic() + timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._conn.poll(remaining):
                    raise _Overrun
                job, verdict, error = self._conn.recv()
                if job == self._job:
                    return verdict, error
        except (EOFError, OSError) as exc:
            raise _WorkerDied(f"exited ({exc!r}, return code {self._process.poll()})") from exc

    def alive(self) -> bool:
        return self._process.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()
        with contextlib.suppress(Exception):
            self._process.kill()
            self._process.wait(timeout=5)


class _Pool:
    """Workers shared by every thread of one process; at most `size` comparisons at once.

    A worker that overruns is killed and a replacement is started at once, so that the next
    comparison does not wait for a whole interpreter start.
    """

    def __init__(self, size: int) -> None:
        self.pid = os.getpid()
        self._size = size
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(size)

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                worker.kill()
        return _Worker()

    def _give(self, worker: _Worker) -> None:
        with self._lock:
            if len(self._idle) < self._size:
                self._idle.append(worker)
                return
        worker.kill()

    def compare(self, answer: str, gold: str, rel_tol: float, timeout_s: float):
        with self._slots:
            try:
                worker = self._take()
            except OSError as exc:
                return False, f"worker_error: cannot start: {exc}"[:200]
            try:
                result = worker.compare(answer, gold, rel_tol, timeout_s)
            except (_Overrun, _WorkerDied) as exc:
                worker.kill()
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    self._give(_Worker())
                if isinstance(exc, _Overrun):
                    return False, "timeout"
                return False, f"worker_error: {exc}"[:200]
            self._give(worker)
            return result

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.kill()


_pool: _Pool | None = None
_pool_lock = threading.Lock()
_cache: OrderedDict[tuple[str, str, float], tuple[bool, str | None]] = OrderedDict()
_cache_lock = threading.Lock()


def _shared_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():  # a forked child must not share pipes
            _pool = _Pool(size=max(1, os.cpu_count() or 1))
        return _pool


def shutdown_workers() -> None:
    """Stop the worker processes (they restart on demand); runs at interpreter exit."""
    with _pool_lock:
        if _pool is not None and _pool.pid == os.getpid():
            _pool.close()


atexit.register(shutdown_workers)


def compare_in_worker(answer: str, gold: str, rel_tol: float, timeout_s: float):
    key = (answer, gold, rel_tol)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    result = _shared_pool().compare(answer, gold, rel_tol, timeout_s)
    if result[1] is None or result[1].startswith("parse_error"):  # deterministic: keep
        with _cache_lock:
            _cache[key] = result
            if len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return result
