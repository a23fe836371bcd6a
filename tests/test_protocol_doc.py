"""docs/protocol.md documents every op and every error kind the daemon can answer."""

import re
from pathlib import Path

from sandman_ray.daemon import sandmand

DOC = (Path(sandmand.__file__).parent / "docs" / "protocol.md").read_text()


def test_every_op_is_documented():
    missing = [op for op in list(sandmand.OPS) + ["hello"] if "`%s`" % op not in DOC]
    assert missing == []


def test_every_error_kind_is_documented():
    source = Path(sandmand.__file__).read_text()
    kinds = set(re.findall(r'RequestError\("(\w+)"', source)) | {"BadRequest", "ProtocolError",
                                                                  "AuthError", "UnknownOp"}
    missing = sorted(k for k in kinds if "`%s`" % k not in DOC)
    assert missing == []


def test_documented_limits_match_the_code():
    assert "64 MiB" in DOC and sandmand.MAX_FRAME == 64 * 1024 * 1024
    assert "1,024" in DOC and sandmand.MAX_IN_FLIGHT == 1024
    assert "16 MiB" in DOC and sandmand.MAX_STREAM_CAP == 16 * 1024 * 1024
    assert "32 MiB" in DOC and sandmand.MAX_READ == 32 * 1024 * 1024
