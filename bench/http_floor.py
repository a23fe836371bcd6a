"""What a minimal HTTP server that runs a program per request costs on this machine.

A server of ``/run_code`` with nothing of a sandbox: each request's program written to
a directory of its own and run by a plain subprocess on the host, answered in
SandboxFusion's shape. No auth, no pool, no lease, no daemon, no reset; the standard
library's asyncio streams and subprocesses, no framework. Beside the host's
subprocess, what it costs is what a Python server's own path costs here, before any
isolation (``http_floor.c`` is the same with no Python).

    python bench/http_floor.py PORT      (serves until killed; bench/fusion.py starts it)
"""

import asyncio
import json
import os
import sys
import tempfile

PYTHON = "/usr/bin/python3"  # the interpreter the host row and the sandbox run


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        request = json.loads(await reader.readexactly(length))
        with tempfile.TemporaryDirectory(prefix="http-floor-") as work:
            with open(os.path.join(work, "main.py"), "w") as fh:
                fh.write(request["code"])
            proc = await asyncio.create_subprocess_exec(
                PYTHON, "main.py", cwd=work, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate((request.get("stdin") or "").encode())
        body = json.dumps({"status": "Success" if proc.returncode == 0 else "Failed",
                           "message": "", "compile_result": None,
                           "run_result": {"status": "Finished", "execution_time": 0.0,
                                          "return_code": proc.returncode,
                                          "stdout": out.decode(), "stderr": err.decode()},
                           "files": {}}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
    finally:
        writer.close()


async def serve(port: int) -> None:
    server = await asyncio.start_server(answer, "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
