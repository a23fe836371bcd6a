"""docs/protocol.md documents every op of the daemon's op table, every field of each
op's schema, and every error kind the daemon can answer."""

import re
from pathlib import Path

from sandman_ray.daemon import sandmand
from sandman_ray.daemon.sandmand import wire

PACKAGE = Path(sandmand.__file__).parent
DOC = (PACKAGE.parent / "docs" / "protocol.md").read_text()
# where an op is defined: a line that starts with its name (in a heading, a table row or
# a list item); its section runs to the next such line or heading
DEFINITION = re.compile(r"^(?:#+ |\| |- )?`(\w+)`", re.M)


def sections():
    """op name -> the doc's text from the op's first definition to the next one."""
    names = {op.name for op in wire.OPS}
    starts = [(m.start(), m.group(1)) for m in DEFINITION.finditer(DOC) if m.group(1) in names]
    ends = sorted([start for start, _ in starts] + [m.start() for m in re.finditer(r"^#", DOC, re.M)]
                  + [len(DOC)])
    found = {}
    for start, name in starts:
        end = next(e for e in ends if e > start)
        found.setdefault(name, DOC[start:end])
    return found


def test_every_op_is_documented():
    assert sorted(op.name for op in wire.OPS if op.name not in sections()) == []


def test_every_field_of_every_op_is_documented_with_its_op():
    documented = sections()
    missing = ["%s.%s" % (op.name, name) for op in wire.OPS for name in op.fields
               if "`%s`" % name not in documented.get(op.name, "")]
    assert missing == []


def test_every_error_kind_is_documented():
    source = "".join(path.read_text() for path in sorted(PACKAGE.rglob("*.py")))
    kinds = set(re.findall(r'RequestError\("(\w+)"', source)) | {"BadRequest", "ProtocolError",
                                                                  "AuthError", "UnknownOp"}
    assert len(kinds) > 8  # the daemon's own kinds were found
    missing = sorted(k for k in kinds if "`%s`" % k not in DOC)
    assert missing == []


def test_documented_version_and_limits_match_the_code():
    assert DOC.startswith("# sandmand wire protocol, version %d" % wire.PROTOCOL_VERSION)
    assert "64 MiB" in DOC and wire.MAX_FRAME == 64 * 1024 * 1024
    assert "1,024" in DOC and wire.MAX_IN_FLIGHT == 1024
    assert "16 MiB" in DOC and wire.MAX_STREAM_CAP == 16 * 1024 * 1024
    assert "32 MiB" in DOC and wire.MAX_READ == 32 * 1024 * 1024
