"""SWE-ReX's tests that read or write this machine's files where they mean the
runtime's, each as the same check inside the sandbox (tests/test_peer_swerex.py
deselects the originals and copies this file in beside them).

- ``test_read_write_file`` writes a file through the runtime, then reads it with
  ``Path.read_text()`` on the machine that runs pytest (the same machine, for SWE-ReX's
  local server); here it is read in the sandbox, with ``cat`` and through the runtime.
- ``test_read_large_file`` writes its 1 MB file with ``Path.write_text()`` on the
  machine that runs pytest, then reads it through the runtime; here the sandbox writes
  it.
"""

import shlex

from swerex.runtime.abstract import ReadFileRequest, WriteFileRequest

from .conftest import _Command as C


async def test_read_write_file(remote_runtime, tmp_path):
    path = tmp_path / "test.txt"
    await remote_runtime.write_file(WriteFileRequest(path=str(path), content="test"))
    assert (await remote_runtime.execute(C(command=["cat", str(path)]))).stdout == "test"
    assert (await remote_runtime.read_file(ReadFileRequest(path=str(path)))).content == "test"


async def test_read_large_file(remote_runtime, tmp_path):
    large_file = tmp_path / "large_file.txt"
    made = await remote_runtime.execute(C(command="mkdir -p %s && head -c 1048576 /dev/zero "
                                                  "| tr '\\0' x > %s" % (
                                                      shlex.quote(str(tmp_path)),
                                                      shlex.quote(str(large_file))),
                                          shell=True))
    assert made.exit_code == 0, made
    response = await remote_runtime.read_file(ReadFileRequest(path=str(large_file)))
    assert len(response.content) == 1024 * 1024 and set(response.content) == {"x"}
