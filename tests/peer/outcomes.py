"""What a peer's suite did, test by test, read from the junit XML report of its run."""

import xml.etree.ElementTree as ElementTree
from pathlib import Path


def outcomes(junit: Path) -> dict:
    """``module::test`` -> passed, failed, skipped or xfailed."""
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = "%s::%s" % (case.get("classname").rsplit(".", 1)[-1], case.get("name"))
        kinds = {child.tag for child in case}
        skipped = case.find("skipped")
        if "failure" in kinds or "error" in kinds:
            found[name] = "failed"
        elif skipped is not None:
            found[name] = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            found[name] = "passed"
    return found
