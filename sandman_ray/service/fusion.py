"""SandboxFusion's API on the service: ``POST /run_code`` and ``GET /v1/ping``.

verl's code rewards (``verl.utils.reward_score.sandbox_fusion``) and the
``sandbox-fusion`` client post one program and its test's stdin to a SandboxFusion
server and read its verdict. Pointed at ``<service URL>/fusion/<API key>`` instead (such
clients send no headers of their own, so the key is in the path; ``Authorization:
Bearer`` works too), each request runs in a sandbox of the service's pool, lent for it
alone and given back at once, so the pool resets it before anyone else's program runs
there (keep a warm pool of the image: ``sandman pool``'s warm config).

A request: ``code``, ``language`` (LANGUAGES), ``compile_timeout`` and ``run_timeout``
(seconds), ``memory_limit_MB`` (the program's address space, where the language's
runtime allows one; -1 none), ``stdin``, ``files`` (path -> base64, written before the
run), ``fetch_files`` (paths read back after it). The answer: ``status`` "Success" (it
compiled and ran to exit 0), "Failed" or "SandboxError", ``message``,
``compile_result`` and ``run_result`` (``status`` "Finished", "TimeLimitExceeded" or
"Error", ``execution_time`` in seconds, ``return_code``, ``stdout``, ``stderr``), and
``files`` (path -> base64). A request SandboxFusion would refuse gets its shape: 422
``{"detail": [{"loc", "msg", "type"}]}``, 413 for a body past REQUEST_MAX.
"""

import base64
import binascii
import posixpath
import shlex
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from sandman_ray.errors import DaemonError, ResultTooLarge

REQUEST_MAX = 8 << 20  # bytes of a request's body
OUTPUT_MAX = 4 << 20  # bytes of a run's stdout, and of its stderr, kept
FETCH_MAX = 16 << 20  # bytes of fetch_files, all of them together
TIMEOUT_MAX_S = 300.0
WORKDIR = "/tmp/fusion"


@dataclass(frozen=True)
class Language:
    """A language's source file, its compile command (None: none) and its run command;
    ``tool``: the program the image must carry; ``limit_memory``: its runtime takes an
    address-space limit (a JVM or Go's runtime reserves more than it uses)."""

    source: str
    compile: Optional[Tuple[str, ...]]
    run: Tuple[str, ...]
    tool: str
    limit_memory: bool = True


LANGUAGES: Dict[str, Language] = {
    "python": Language("main.py", None, ("python3", "main.py"), "python3"),
    "bash": Language("main.sh", None, ("bash", "main.sh"), "bash"),
    "c": Language("main.c", ("gcc", "-O2", "-o", "main", "main.c", "-lm"), ("./main",), "gcc"),
    "cpp": Language("main.cpp", ("g++", "-O2", "-std=c++17", "-o", "main", "main.cpp"),
                    ("./main",), "g++"),
    "nodejs": Language("main.js", None, ("node", "main.js"), "node", False),
    "go": Language("main.go", ("go", "build", "-o", "main", "main.go"), ("./main",), "go", False),
    "java": Language("Main.java", ("javac", "Main.java"), ("java", "-cp", ".", "Main"), "javac",
                     False),
}


class Invalid(Exception):
    """A request SandboxFusion would refuse: its status and ``detail``."""

    def __init__(self, status: int, detail):
        super().__init__(str(detail))
        self.status, self.detail = status, detail


def _wrong(where: str, message: str, kind: str = "value_error") -> Invalid:
    return Invalid(422, [{"loc": ["body", where], "msg": message, "type": kind}])


@dataclass
class Request:
    code: str
    language: str
    compile_timeout: float = 10.0
    run_timeout: float = 10.0
    memory_limit_mb: int = -1
    stdin: Optional[str] = None
    files: Dict[str, bytes] = field(default_factory=dict)
    fetch_files: List[Tuple[str, str]] = field(default_factory=list)  # (as asked, path)


def _seconds(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 < value <= TIMEOUT_MAX_S:
        raise _wrong(name, "a number of seconds above 0, at most %g" % TIMEOUT_MAX_S)
    return float(value)


def _path(name: str, where: str) -> str:
    """A path of the sandbox: absolute, or under WORKDIR."""
    if not isinstance(name, str) or not name or "\0" in name or len(name) > 4096:
        raise _wrong(where, "a path of the sandbox")
    return posixpath.normpath(posixpath.join(WORKDIR, name))


def parse(body) -> Request:
    """The request of a ``/run_code`` body, or Invalid."""
    if not isinstance(body, dict):
        raise Invalid(422, [{"loc": ["body"], "msg": "a JSON object", "type": "type_error"}])
    code, language = body.get("code"), body.get("language")
    if not isinstance(code, str):
        raise _wrong("code", "field required" if code is None else "a string",
                     "missing" if code is None else "string_type")
    if not isinstance(language, str) or language not in LANGUAGES:
        raise _wrong("language", "Input should be %s" % ", ".join(map(repr, LANGUAGES)), "enum")
    memory = body.get("memory_limit_MB", -1)
    if memory is None:
        memory = -1
    if isinstance(memory, bool) or not isinstance(memory, int) or memory == 0 or memory < -1:
        raise _wrong("memory_limit_MB", "a whole number of MB above 0, or -1 for none")
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise _wrong("stdin", "a string")
    files = body.get("files") or {}
    if not isinstance(files, dict):
        raise _wrong("files", "an object of path -> base64 content")
    decoded = {}
    for name, content in files.items():
        if content is None:  # the client package's "no content": nothing written
            continue
        if not isinstance(content, str):
            raise _wrong("files", "%r: base64 content as a string" % name[:100])
        try:
            decoded[_path(name, "files")] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise _wrong("files", "%r: not base64" % name[:100]) from None
    fetch = body.get("fetch_files") or []
    if not isinstance(fetch, list) or len(fetch) > 100:
        raise _wrong("fetch_files", "a list of at most 100 paths")
    return Request(code, language, _seconds(body, "compile_timeout", 10.0),
                   _seconds(body, "run_timeout", 10.0), memory, stdin, decoded,
                   [(name, _path(name, "fetch_files")) for name in fetch])


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _result(r) -> dict:
    """A command's result as SandboxFusion says it (``r``: an ExecResult)."""
    status = "TimeLimitExceeded" if r.timed_out else "Finished"
    return {"status": status, "execution_time": r.duration_s,
            "return_code": None if r.timed_out else r.exit_code,
            "stdout": _text(r.stdout), "stderr": _text(r.stderr)}


def _command(argv: Tuple[str, ...], memory_mb: int) -> str:
    """A shell command that runs ``argv`` in at most ``memory_mb`` of address space."""
    return "ulimit -v %d && exec %s" % (memory_mb * 1024, " ".join(map(shlex.quote, argv)))


def answer(status: str = "Success", message: str = "") -> dict:
    """An answer with nothing run yet (SandboxError: nothing will be)."""
    return {"status": status, "message": message, "compile_result": None,
            "run_result": None, "executor_pod_name": None, "files": {}}


async def run(client, request: Request, carried: set) -> dict:
    """Run ``request`` in the sandbox of ``client`` (an AsyncDaemonClient of a sandbox
    lent for it alone): the answer SandboxFusion gives. ``carried``: the languages
    whose tool the image was seen to carry (asked once, then added)."""
    language = LANGUAGES[request.language]
    if request.language not in carried:
        found = await client.exec(["sh", "-c", "command -v %s" % shlex.quote(language.tool)])
        if found.exit_code != 0:
            return answer("SandboxError", "language %s: this sandbox's image has no %s"
                          % (request.language, language.tool))
        carried.add(request.language)
    out = answer()
    for path, content in request.files.items():  # their directories made as they go
        await client.write_file(path, content)
    await client.write_file(posixpath.join(WORKDIR, language.source), request.code.encode())
    if language.compile is not None:
        compiled = await client.exec(list(language.compile), cwd=WORKDIR,
                                     timeout=request.compile_timeout, max_output=OUTPUT_MAX)
        out["compile_result"] = _result(compiled)
        if compiled.timed_out or compiled.exit_code != 0:
            out["status"] = "Failed"
            return out
    memory = request.memory_limit_mb if language.limit_memory else -1
    ran = await client.exec(
        ["sh", "-c", _command(language.run, memory)] if memory > 0 else list(language.run),
        cwd=WORKDIR, timeout=request.run_timeout, max_output=OUTPUT_MAX,
        stdin=(request.stdin or "").encode())
    out["run_result"] = _result(ran)
    left = FETCH_MAX
    for name, path in dict(request.fetch_files).items():  # each name once
        try:
            data = await client.read_file(path, max_bytes=left)
        except DaemonError:  # a file the program did not leave is not fetched
            continue
        except ResultTooLarge:
            out["message"] = "fetch_files: at most %d bytes in all; %s and after are " \
                             "left out" % (FETCH_MAX, name)
            break
        left -= len(data)
        out["files"][name] = base64.b64encode(data).decode()
    if ran.timed_out or ran.exit_code != 0:
        out["status"] = "Failed"
    return out
