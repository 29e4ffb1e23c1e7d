"""`fucina repl` driven in a real terminal (a pseudo-terminal): two turns that share
history, /reset, Ctrl-C during an answer, Ctrl-D to leave."""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import time

import pytest

pty = pytest.importorskip("pty")

PROMPT = b">>> "


class Terminal:
    """A child process on the slave side of a pty: its controlling terminal, so
    Ctrl-C (\\x03) typed here becomes SIGINT there, as in a real terminal."""

    def __init__(self, argv, env):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            # as a terminal's shell starts it: a parent that started these tests in
            # the background without job control (`(pytest &)`) passed SIGINT on as
            # ignored, and Python then installs no KeyboardInterrupt for Ctrl-C
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        self.out = b""

    def read_until(self, pattern: bytes, timeout: float = 300) -> bytes:
        """Read until `pattern` (a regex) appears after what was consumed before."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.out):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; "
                                     f"got {self.out[-2000:]!r}")
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"terminal closed while waiting for "
                                         f"{pattern!r}; got {self.out[-2000:]!r}")
                self.out += chunk
        m = re.search(pattern, self.out)
        seen, self.out = self.out[:m.end()], self.out[m.end():]
        return seen

    def type(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:  # keep draining, or a child blocked on a full terminal never exits
                if select.select([self.fd], [], [], 0.2)[0]:
                    self.out += os.read(self.fd, 4096)
            except OSError:
                time.sleep(0.1)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the repl did not exit")

    def close(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


@pytest.fixture
def repl(coder_path):
    env = dict(os.environ, TERM="dumb", PYTHONUNBUFFERED="1")
    term = Terminal([sys.executable, "-m", "fucina_course", "repl",
                     "qwen2.5-coder-0.5b", "--temp", "0", "--ctx", "1024"], env)
    yield term
    term.close()


def answer(term: Terminal, line: str) -> str:
    term.type(line.encode() + b"\r")
    return term.read_until(rb"\n" + re.escape(PROMPT)).decode("utf-8", "replace")


def test_two_turns_reset_ctrl_c_and_ctrl_d(repl):
    repl.read_until(re.escape(PROMPT))
    first = answer(repl, "What is the capital of France?")
    assert "Paris" in first and "tok/s" in first
    second = answer(repl, "And of Italy?")     # needs the first turn's history
    assert "Rome" in second

    assert "(conversation cleared)" in answer(repl, "/reset")
    after = answer(repl, "What did I ask you before?")
    assert "France" not in after and "Italy" not in after

    # Ctrl-C in the middle of a long answer: back to the prompt, still usable.
    repl.type(b"Count from 1 to 300, separated by commas.\r")
    repl.read_until(rb"\d+, \d+, \d+")       # the answer is streaming
    repl.type(b"\x03")
    repl.read_until(rb"\(interrupted\)")
    repl.read_until(re.escape(PROMPT))
    assert "Paris" in answer(repl, "What is the capital of France?")

    repl.type(b"\x04")                        # Ctrl-D at the prompt
    assert repl.wait() == 0
