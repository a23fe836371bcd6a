"""Errors keep their fields when pickled: Ray pickles them across every task and
actor call, and an error that cannot be rebuilt reaches the caller as Ray's
UnserializableException instead of itself."""

import pickle

import pytest

from sandman_ray.errors import (
    AcquireTimeout, DaemonError, ExecTimeout, ProviderError, SandboxLost)


@pytest.mark.parametrize("error", [
    DaemonError("FileNotFoundError", "no such file: /x", "read", "ENOENT"),
    ExecTimeout("exec on sandbox s1: timed out", result={"exit_code": None}),
    ProviderError("quota exceeded", "throttled"),
    SandboxLost("sandbox s1 is gone"),
    AcquireTimeout("none ready"),
])
def test_errors_survive_pickling(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy.__dict__ == error.__dict__
