"""kvplug_testing.engine_process, both ends, with tiny real drivers (Python modules written to
the test's directory): the ready line, error answers, a driver that dies mid-command or
at start, one that hangs or ignores ``exit`` (killed with every process of its session), and
stdout noise from the driver and the processes it starts."""

from __future__ import annotations

import io
import json
import re
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kvplug_testing.engine_process import (
    EngineCommandFailed,
    EngineProcess,
    EngineStartFailed,
    command_loop,
)

DRIVER = textwrap.dedent(
    """
    import contextlib, json, os, subprocess, sys, time
    from kvplug_testing.engine_process import serve

    SLEEPER = "import time; time.sleep(600)"
    NOISE = (
        "import sys; print('loading weights'); print('{\\"noise\\": true}'); print('{half');"
        "sys.stdout.flush(); sys.stdout.buffer.write(bytes([255, 254, 10]))"
    )

    def die(command):
        child = os.fork()
        if child == 0:  # a child that keeps the answers' pipe open
            time.sleep(600)
            os._exit(0)
        print(f"dying now; child {child} keeps the pipe", file=sys.stderr, flush=True)
        os._exit(3)

    def noise(command):
        print("the driver's own print", flush=True)
        os.write(1, b"written to file descriptor 1\\n")
        subprocess.run([sys.executable, "-c", NOISE], check=True)
        return {"quiet": True}

    @contextlib.contextmanager
    def engine():
        mode = sys.argv[1]
        print(f"starting in mode {mode}", file=sys.stderr, flush=True)
        if mode == "fail":
            raise ValueError("no model at /nowhere")
        if mode == "hang":
            time.sleep(600)
        sleeper = subprocess.Popen([sys.executable, "-c", SLEEPER])
        yield {
            "echo": lambda command: {"echo": command["text"]},
            "raise": lambda command: {}[command["key"]],
            "sleep": lambda command: time.sleep(command["seconds"]) or {},
            "pids": lambda command: {"pids": [os.getpid(), sleeper.pid]},
            "die": die,
            "noise": noise,
        }
        print("engine shut down", file=sys.stderr, flush=True)
        sleeper.kill()

    if __name__ == "__main__":
        if sys.argv[1] == "exit-early":
            sys.exit("bad arguments")
        sys.exit(serve(engine))
    """
)

STUBBORN = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]
    )
    print(json.dumps({"ready": True, "pids": [os.getpid(), child.pid]}), flush=True)
    for line in sys.stdin:  # every command ignored, exit included
        pass
    time.sleep(600)
    """
)

NOISY = textwrap.dedent(
    """
    import json, subprocess, sys
    NOISE = "print('progress 10%'); print('[1, 2]'); print('{not json')"
    subprocess.run([sys.executable, "-c", NOISE])  # its stdout is this driver's: the pipe
    print(json.dumps({"ready": True, "start_seconds": 0.5}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        subprocess.run([sys.executable, "-c", NOISE])
        print(json.dumps({"echo": command["op"]}), flush=True)
        if command["op"] == "exit":
            break
    """
)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which no parent has reaped yet, does not)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


def engine(tmp_path: Path, source: str, *args: str, **timeouts: float) -> EngineProcess:
    driver = tmp_path / "driver.py"
    driver.write_text(source)
    return EngineProcess([sys.executable, driver, *args], log=tmp_path / "engine.log", **timeouts)


def test_a_ready_driver_answers_commands_and_exits_by_itself_on_close(tmp_path: Path) -> None:
    with engine(tmp_path, DRIVER, "ok") as process:
        assert process.ready["ready"] is True
        assert process.start_seconds > 0
        assert process.ask({"op": "echo", "text": "hi"}) == {"echo": "hi"}
        pids = process.ask({"op": "pids"})["pids"]
    assert process.returncode == 0, process.log_tail()  # it exited: nothing was killed
    assert "engine shut down" in process.log_tail()
    assert _wait_gone(pids) == []


def test_an_error_answer_names_the_op_the_error_and_the_log_and_the_engine_goes_on(
    tmp_path: Path,
) -> None:
    with engine(tmp_path, DRIVER, "ok") as process:
        with pytest.raises(EngineCommandFailed) as failed:
            process.ask({"op": "raise", "key": "no-such-key"})
        error = failed.value
        assert (error.op, error.kind, error.message) == ("raise", "KeyError", "'no-such-key'")
        assert "Traceback" in error.log_tail and "no-such-key" in error.log_tail
        assert "'raise'" in str(error) and "KeyError" in str(error)
        assert "starting in mode ok" in str(error)
        with pytest.raises(EngineCommandFailed, match=r"unknown op 'generate'.*echo, exit"):
            process.ask({"op": "generate"})
        assert process.ask({"op": "echo", "text": "still here"}) == {"echo": "still here"}


def test_a_driver_that_dies_mid_command_is_reported_at_once_with_its_log(
    tmp_path: Path,
) -> None:
    """A process the driver forked keeps its stdout open: the end of the pipe never comes, the
    driver's exit tells."""
    process = engine(tmp_path, DRIVER, "ok").start()
    pids = process.ask({"op": "pids"})["pids"]
    started = time.monotonic()
    with pytest.raises(EngineCommandFailed) as failed:
        process.ask({"op": "die"}, timeout=120)
    assert time.monotonic() - started < 30
    assert failed.value.kind == "EngineExited"
    assert "exit status 3" in failed.value.message
    forked = re.search(r"dying now; child (\d+) keeps the pipe", failed.value.log_tail)
    assert forked is not None, failed.value.log_tail
    assert process.process is None and process.returncode == 3
    assert _wait_gone([*pids, int(forked.group(1))]) == []


def test_a_failed_start_raises_the_drivers_error_with_the_end_of_its_log(
    tmp_path: Path,
) -> None:
    with pytest.raises(EngineStartFailed) as failed:
        engine(tmp_path, DRIVER, "fail").start()
    error = failed.value
    assert (error.kind, error.message) == ("ValueError", "no model at /nowhere")
    assert "starting in mode fail" in error.log_tail
    assert "Traceback" in error.log_tail
    assert "no model at /nowhere" in str(error) and "starting in mode fail" in str(error)


def test_a_driver_that_ends_before_its_ready_line_raises_its_status_and_log(
    tmp_path: Path,
) -> None:
    process = engine(tmp_path, DRIVER, "exit-early")
    with pytest.raises(EngineStartFailed) as failed:
        process.start()
    assert failed.value.kind == "EngineExited"
    assert "exit status 1" in failed.value.message
    assert "bad arguments" in failed.value.log_tail
    assert process.process is None


def test_a_driver_that_never_gets_ready_is_stopped_after_the_start_timeout(
    tmp_path: Path,
) -> None:
    # Long enough for the driver to start and log on a busy machine; its wait is what times out.
    process = engine(tmp_path, DRIVER, "hang", start_timeout=8)
    started = time.monotonic()
    with pytest.raises(EngineStartFailed) as failed:
        process.start()
    assert time.monotonic() - started < 60
    assert failed.value.kind == "EngineTimeout"
    assert "starting in mode hang" in failed.value.log_tail
    assert process.process is None and process.returncode == -9


def test_a_command_past_its_timeout_stops_the_engine_and_its_session(tmp_path: Path) -> None:
    process = engine(tmp_path, DRIVER, "ok").start()
    pids = process.ask({"op": "pids"})["pids"]
    with pytest.raises(EngineCommandFailed) as failed:
        process.ask({"op": "sleep", "seconds": 60}, timeout=1)
    assert failed.value.kind == "EngineTimeout"
    assert process.process is None
    assert _wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="not running"):
        process.ask({"op": "echo", "text": "anyone?"})


def test_a_driver_that_ignores_exit_is_killed_with_every_process_of_its_session(
    tmp_path: Path,
) -> None:
    process = engine(tmp_path, STUBBORN).start()
    pids = process.ready["pids"]
    assert all(_alive(pid) for pid in pids)
    started = time.monotonic()
    process.close(timeout=1)
    assert time.monotonic() - started < 15
    assert process.returncode == -9
    assert _wait_gone(pids) == [], "a process of the engine's session outlived close()"


def test_noise_of_the_driver_and_its_children_lands_in_the_log_not_in_the_answers(
    tmp_path: Path,
) -> None:
    with engine(tmp_path, DRIVER, "ok") as process:
        assert process.ask({"op": "noise"}) == {"quiet": True}
        assert process.ask({"op": "echo", "text": "next"}) == {"echo": "next"}
    log = (tmp_path / "engine.log").read_text(errors="replace")
    for line in ("the driver's own print", "written to file descriptor 1", "loading weights"):
        assert line in log
    assert '{"noise": true}' in log


def test_lines_on_stdout_that_are_no_json_object_are_ignored(tmp_path: Path) -> None:
    """A driver whose child prints to the answers' pipe itself (before any redirection)."""
    with engine(tmp_path, NOISY) as process:
        assert process.start_seconds == 0.5
        assert process.ask({"op": "first"}) == {"echo": "first"}
        assert process.ask({"op": "second"}) == {"echo": "second"}
    assert process.returncode == 0


def test_the_command_loop_answers_a_bad_line_with_an_error_and_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    commands = io.StringIO(
        'not json\n[1]\n\n{"op": "double", "n": 2}\n{"op": "double"}\n{"op": "exit"}\n'
        '{"op": "double", "n": 5}\n'
    )
    answers = io.StringIO()
    command_loop({"double": lambda c: {"n": 2 * c["n"]}}, commands, answers)
    lines = [json.loads(line) for line in answers.getvalue().splitlines()]
    assert [line.get("type") for line in lines] == [
        "JSONDecodeError",
        "ValueError",
        None,
        "KeyError",
        None,
    ]
    assert lines[2] == {"n": 4}
    assert lines[4] == {"ok": True}  # and nothing read after exit
    assert "KeyError: 'n'" in capsys.readouterr().err
