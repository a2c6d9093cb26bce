"""A real engine in a child process, driven by JSON lines: both ends of the protocol that
kvplug's engine tests and benchmarks share (``kvplug_vllm.testing_engine``,
``kvplug_sglang.testing_engine``; LMCache's tests run the vLLM one).

The protocol. The child (a *driver*) prints one JSON object line when it is ready
(``{"ready": true, "start_seconds": ...}``) or when its start failed (``{"ready": false,
"error": ..., "type": ...}``, then exit status 1). It then reads one command a line from stdin,
a JSON object with an ``op`` (``{"op": "generate", ...}``), and answers each with one JSON
object line: its handler's answer, or ``{"error": ..., "type": ...}`` when the handler raised.
``{"op": "exit"}`` answers ``{"ok": true}`` and ends the command loop. Its stderr is its log.

Driver side, :func:`serve` is all of it: the answers keep the original stdout while file
descriptor 1 goes to stderr (:func:`protocol_stream`: what the engine, its libraries and the
processes it starts print cannot corrupt the answers), the ready or start-failed line, and the
command loop (:func:`command_loop`). A driver ``echo_engine.py``::

    import contextlib
    from kvplug_testing.engine_process import serve

    @contextlib.contextmanager
    def engine():
        state = {"echoed": 0}  # build the engine here: an exception is a failed start

        def echo(command):
            state["echoed"] += 1
            return {"echo": command["text"], "echoed": state["echoed"]}

        yield {"echo": echo}  # its ops; shut the engine down after the yield

    if __name__ == "__main__":
        raise SystemExit(serve(engine))

Client side, :class:`EngineProcess` starts a driver in a session of its own and talks to it::

    with EngineProcess([sys.executable, "echo_engine.py"], log=tmp_path / "engine.log") as e:
        assert e.ask({"op": "echo", "text": "hi"}) == {"echo": "hi", "echoed": 1}

A failed start raises :class:`EngineStartFailed`, a failed command :class:`EngineCommandFailed`;
both carry the end of the driver's log.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from kvplug_testing.process import die_with_this_process

Command = dict[str, Any]
Answer = dict[str, Any]
Handler = Callable[[Command], Answer]
"""One op of a driver: the command in, the answer out (raise to answer an error)."""

START_TIMEOUT = 300.0
"""Seconds a driver may take to say it is ready, by default (engines on a busy 2-core
machine)."""
COMMAND_TIMEOUT = 300.0
"""Seconds a driver may take to answer a command, by default."""
EXIT_TIMEOUT = 60.0
"""Seconds :meth:`EngineProcess.close` waits for the driver to exit before it kills the
session."""
EXIT_GRACE = 1.0
"""Seconds the client waits for a line still in the pipe once the driver has exited."""

_live: set[subprocess.Popen[str]] = set()
"""Every driver started and not yet closed: its session is killed when the interpreter exits."""


# -- driver side -----------------------------------------------------------------------------


def protocol_stream() -> IO[str]:
    """The stream to answer on: the original stdout, kept on a file descriptor of its own that
    no child process inherits; file descriptor 1 then goes to stderr, so that whatever the
    engine, its libraries and the processes it starts print (vLLM's and SGLang's processes log
    to stdout) lands in the log, not in the answers. Call it before the engine starts any
    process."""
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")  # os.dup: not inheritable
    os.dup2(2, 1)
    return answers


def send(answers: IO[str], message: Answer) -> None:
    """Write ``message`` as one JSON line and flush it."""
    answers.write(json.dumps(message) + "\n")
    answers.flush()


def _error_answer(error: BaseException) -> Answer:
    traceback.print_exception(error)  # the whole story goes to the log
    return {"error": str(error) or repr(error), "type": type(error).__name__}


def _command(line: str) -> Command:
    command = json.loads(line)
    if not isinstance(command, dict) or not isinstance(command.get("op"), str):
        raise ValueError(f'a command is a JSON object with an "op" string, not {line.strip()!r}')
    return command


def command_loop(handlers: Mapping[str, Handler], commands: IO[str], answers: IO[str]) -> None:
    """Answer each command line of ``commands`` on ``answers`` until ``exit`` or the end of
    ``commands``: ``handlers[op](command)``'s answer, or ``{"error": ..., "type": ...}`` (and
    the traceback on stderr) when the line is no command, names an unknown op or its handler
    raises. ``exit`` is built in: it answers ``{"ok": true}`` and returns.

    >>> import io
    >>> answers = io.StringIO()
    >>> commands = io.StringIO('{"op": "add", "a": 1, "b": 2}\\n{"op": "exit"}\\n')
    >>> command_loop({"add": lambda c: {"sum": c["a"] + c["b"]}}, commands, answers)
    >>> answers.getvalue()
    '{"sum": 3}\\n{"ok": true}\\n'
    """
    for line in commands:
        if not line.strip():
            continue
        try:
            command = _command(line)
            if command["op"] == "exit":
                send(answers, {"ok": True})
                return
            handler = handlers.get(command["op"])
            if handler is None:
                known = ", ".join(sorted([*handlers, "exit"]))
                raise ValueError(f"unknown op {command['op']!r}; this engine knows {known}")
            answer = handler(command)
        except Exception as error:
            answer = _error_answer(error)
        send(answers, answer)


def serve(
    engine: Callable[[], AbstractContextManager[Mapping[str, Handler]]],
    commands: IO[str] | None = None,
) -> int:
    """A driver's whole protocol; its exit status (1 when the start failed). Answers go to
    :func:`protocol_stream`; ``engine()`` is entered (it starts the engine and gives its ops:
    an exception there is answered as the failed start), the ready line is sent with the
    seconds that took, :func:`command_loop` answers ``commands`` (stdin), then ``engine()`` is
    left (its shutdown)."""
    answers = protocol_stream()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        try:
            handlers = stack.enter_context(engine())
        except Exception as error:
            send(answers, {"ready": False, **_error_answer(error)})
            return 1
        send(answers, {"ready": True, "start_seconds": time.perf_counter() - started})
        command_loop(handlers, sys.stdin if commands is None else commands, answers)
    return 0


# -- client side -----------------------------------------------------------------------------


class EngineError(RuntimeError):
    """A driver failed: ``kind`` (its exception's type name, or ``EngineExited`` when the
    process ended, ``EngineTimeout`` when it did not answer in time), ``message`` and
    ``log_tail`` (the end of its log), all three in the text."""

    def __init__(self, what: str, kind: str, message: str, log_tail: str) -> None:
        super().__init__(f"{what}: {kind}: {message}\n--- the end of its log ---\n{log_tail}")
        self.kind = kind
        self.message = message
        self.log_tail = log_tail


class EngineStartFailed(EngineError):
    """The driver did not say it was ready: its start failed, it ended or it took too long."""

    def __init__(self, kind: str, message: str, log_tail: str) -> None:
        super().__init__("the engine did not start", kind, message, log_tail)


class EngineCommandFailed(EngineError):
    """A command ``op`` failed: an error answer (the engine goes on), or the driver ended or
    did not answer in time (then it has been stopped)."""

    def __init__(self, op: str, kind: str, message: str, log_tail: str) -> None:
        super().__init__(f"the engine's {op!r} failed", kind, message, log_tail)
        self.op = op


def _has_exited(process: subprocess.Popen[str]) -> bool:
    """Whether ``process`` has exited, without reaping it: its pid, which is its session's id,
    stays taken until the session has been killed."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_session(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_live):
        _kill_session(process)


def _exit_status(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def module_argv(
    module: str, *args: str | os.PathLike[str], python: str | os.PathLike[str] = sys.executable
) -> list[str]:
    """``python -m module args...``, the argv of a driver that is a module.

    >>> module_argv("kvplug_vllm.testing_engine", Path("/models/m"), "null", python="python3")
    ['python3', '-m', 'kvplug_vllm.testing_engine', '/models/m', 'null']
    """
    return [os.fspath(python), "-m", module, *(os.fspath(arg) for arg in args)]


class EngineProcess:
    """A driver (``argv``, speaking :func:`serve`'s protocol) as a child process in a session of
    its own, with ``env`` added to this process's environment and its stderr appended to
    ``log``. :meth:`start` waits for its ready line (``start_timeout`` seconds), :meth:`ask`
    sends a command and returns its answer (``command_timeout`` seconds), :meth:`close` asks it
    to exit and then kills its whole session, so that no process it started outlives it (the
    session is killed too when this interpreter exits, and the driver when this process dies).
    Lines of its stdout that are no JSON object are ignored.

    Example::

        engine = EngineProcess([sys.executable, "-m", "my_driver"], log=tmp_path / "e.log")
        with engine:  # start() on entry, close() on exit
            answer = engine.ask({"op": "generate", "prompt": [1, 2, 3]})
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        start_timeout: float = START_TIMEOUT,
        command_timeout: float = COMMAND_TIMEOUT,
    ) -> None:
        self.argv = [str(arg) for arg in argv]
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log)
        self.start_timeout = start_timeout
        self.command_timeout = command_timeout
        self.process: subprocess.Popen[str] | None = None
        self.ready: Answer = {}
        """The ready line."""
        self.start_seconds = 0.0
        """What the driver took to start, as its ready line says."""
        self.returncode: int | None = None
        """The driver's exit status once closed (negative: killed by that signal)."""
        self._lines: queue.Queue[Answer | None] = queue.Queue()

    def start(self) -> Self:
        """Start the driver and wait for its ready line; raises :class:`EngineStartFailed`
        (with the driver stopped) when it answers a failed start, ends or takes longer than
        ``start_timeout``."""
        if self.process is not None:
            raise RuntimeError("this engine process is already started")
        self._lines = queue.Queue()
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                errors="replace",
                env=self.env,
                start_new_session=True,
                preexec_fn=die_with_this_process(),
            )
        _live.add(self.process)
        threading.Thread(
            target=self._read, args=(self.process.stdout,), name="engine-answers", daemon=True
        ).start()
        try:
            ready = self._next_line(self.start_timeout)
        except TimeoutError:
            self.close(timeout=0)
            message = f"no ready line within {self.start_timeout:g} s; the engine was stopped"
            raise EngineStartFailed("EngineTimeout", message, self.log_tail()) from None
        except BaseException:  # an interrupted wait leaves no engine behind either
            self.close(timeout=0)
            raise
        if ready is None:
            self.close()
            message = f"the engine process ended ({_exit_status(self.returncode)}) before ready"
            raise EngineStartFailed("EngineExited", message, self.log_tail())
        if not ready.get("ready"):
            self.close()
            kind, message = str(ready.get("type", "?")), str(ready.get("error", ready))
            raise EngineStartFailed(kind, message, self.log_tail())
        self.ready = ready
        self.start_seconds = float(ready.get("start_seconds", 0.0))
        return self

    def ask(self, command: Command, timeout: float | None = None) -> Answer:
        """Send ``command`` and return its answer within ``timeout`` seconds (default
        ``command_timeout``). An error answer raises :class:`EngineCommandFailed` with the
        driver's error (the engine goes on); so do a driver that ends and one that does not
        answer in time, after stopping it."""
        process = self.process
        if process is None or process.stdin is None:
            raise RuntimeError("the engine process is not running: start() it first")
        op = str(command.get("op"))
        line = json.dumps(command) + "\n"
        timeout = self.command_timeout if timeout is None else timeout
        try:
            process.stdin.write(line)
            process.stdin.flush()
            answer = self._next_line(timeout)
        except TimeoutError:
            self.close(timeout=0)
            message = f"no answer within {timeout:g} s; the engine was stopped"
            raise EngineCommandFailed(op, "EngineTimeout", message, self.log_tail()) from None
        except BrokenPipeError:
            answer = None
        if answer is None:
            self.close()
            message = f"the engine process ended ({_exit_status(self.returncode)})"
            raise EngineCommandFailed(op, "EngineExited", message, self.log_tail())
        if "error" in answer:
            kind, message = str(answer.get("type", "?")), str(answer["error"])
            raise EngineCommandFailed(op, kind, message, self.log_tail())
        return answer

    def close(self, timeout: float = EXIT_TIMEOUT) -> None:
        """Ask the driver to exit, wait up to ``timeout`` seconds, then kill its session (the
        driver if it lingers, and every process it started); :attr:`returncode` is then its
        exit status. Does nothing when not running."""
        process, self.process = self.process, None
        if process is None:
            return
        try:
            if not _has_exited(process) and process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                    process.stdin.flush()
            deadline = time.monotonic() + timeout
            while not _has_exited(process) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            _kill_session(process)
            self.returncode = process.wait()
            _live.discard(process)
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the driver's log."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 64 * 1024))
                text = log.read().decode(errors="replace")
        except OSError as error:
            return f"(no log: {error})"
        return "\n".join(text.splitlines()[-lines:])

    def _read(self, stream: IO[str]) -> None:
        """The reader thread: every JSON object line of the driver's stdout, then None at its
        end. The stream is closed here, never under a thread reading it."""
        with stream:
            for line in stream:
                with contextlib.suppress(ValueError):
                    message = json.loads(line)
                    if isinstance(message, dict):
                        self._lines.put(message)
        self._lines.put(None)

    def _next_line(self, timeout: float) -> Answer | None:
        """The driver's next JSON line; None once it has ended (also when a process it started
        still holds its stdout open); TimeoutError after ``timeout`` seconds."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        exited_at: float | None = None
        while True:
            with contextlib.suppress(queue.Empty):
                return self._lines.get(timeout=0.05)
            now = time.monotonic()
            if exited_at is None and _has_exited(self.process):
                exited_at = now
            if exited_at is not None and now - exited_at > EXIT_GRACE:
                return None
            if now > deadline:
                raise TimeoutError(f"no line from the engine within {timeout:g} s")

    def __enter__(self) -> Self:
        return self.start() if self.process is None else self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


__all__ = [
    "COMMAND_TIMEOUT",
    "START_TIMEOUT",
    "Answer",
    "Command",
    "EngineCommandFailed",
    "EngineError",
    "EngineProcess",
    "EngineStartFailed",
    "Handler",
    "command_loop",
    "module_argv",
    "protocol_stream",
    "send",
    "serve",
]
