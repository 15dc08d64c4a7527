"""The example's tool: run a Python snippet in a child process with limits, return what it printed.

Limits (each can be changed per call):

* CPU time ``cpu_s`` (``RLIMIT_CPU``: the kernel kills a busy loop), address space ``memory_mb``
  (``RLIMIT_AS``: a large allocation raises ``MemoryError``), file size ``file_mb`` (``RLIMIT_FSIZE``)
  and no core dumps;
* wall time ``wall_s``: a snippet that sleeps or blocks is killed with its process group;
* output: at most ``max_output`` characters of stdout/stderr are returned;
* no network and no new processes: an audit hook installed before the snippet runs refuses socket
  creation and connection, name resolution, ``subprocess``/``os.system``/``exec``/``fork``/``spawn``
  and loading native libraries through ``ctypes``. An audit hook cannot be removed from Python code,
  but it is not an OS boundary: code that reaches native code some other way is not stopped — run the
  trainer's rollout side in a container without network when the policy is not trusted;
* files: written only inside a fresh empty working directory (removed afterwards); reading is not
  restricted (the snippet sees the machine's files as the trainer's user does);
* an empty environment, ``python -I`` (no user site, no ``PYTHON*`` variables, the script's directory
  not on the path).

    run_python("print(12*34)")           -> "408"
    run_python("while True: pass")       -> "error: the code used more than 2 s of CPU time"
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile

# Runs before the snippet, in the child: refuse the audit events of network access and new processes.
_GUARD = r'''
import sys
def _guard(event, args, _deny=("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                               "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym")):
    if event.startswith(_deny):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and isinstance(args[0], str) and args[1] and any(c in args[1] for c in "wax+"):
        import os
        if not os.path.abspath(args[0]).startswith(os.getcwd() + os.sep):
            raise PermissionError(f"sandbox: writing {args[0]} (outside the working directory) is not allowed")
sys.addaudithook(_guard)
del _guard
'''


def _limits(cpu_s: int, memory_mb: int, file_mb: int):
    def apply():
        os.setsid()  # its own process group, killed whole on timeout
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_python(code: str, *, cpu_s: int = 2, wall_s: float = 5.0, memory_mb: int = 512, file_mb: int = 1,
               max_output: int = 1000) -> str:
    """What the snippet printed (stdout, then stderr), or ``error: ...`` saying which limit it hit."""
    if not isinstance(code, str) or not code.strip():
        return "error: the code is empty; pass a Python snippet as the code argument"
    with tempfile.TemporaryDirectory(prefix="slime-sandbox-") as workdir:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _GUARD + "\n" + code], cwd=workdir, env={},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=_limits(cpu_s, memory_mb, file_mb))
        try:
            stdout, stderr = proc.communicate(timeout=wall_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"error: the code ran longer than {wall_s:g} s and was stopped"
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and b"MemoryError" not in stderr:
        return f"error: the code used more than {cpu_s} s of CPU time"
    text = (stdout + stderr).decode("utf-8", errors="replace").strip()
    if proc.returncode != 0:
        lines = text.splitlines()
        text = "error: " + (lines[-1] if lines else f"exit status {proc.returncode}")  # the exception line
    return text[:max_output]
