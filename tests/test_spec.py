"""SandboxSpec and PoolConfig refuse bad input with a message naming the field."""

import pytest

from sandman_ray.spec import PoolConfig, SandboxSpec, check_pool_name, parse_bytes


@pytest.mark.parametrize("kwargs, words", [
    ({"image": ""}, "image must be a non-empty string"),
    ({"image": "busybox"}, "is not builtin:debian, host, dir:/path"),
    ({"image": "dir:relative"}, "needs an absolute path"),
    ({"cpu": 0}, "cpu must be a positive number"),
    ({"memory": "lots"}, "memory must be bytes or a size"),
    ({"pids": 0}, "pids must be a positive int"),
    ({"env": {"A=B": "x"}}, "env must map names to strings"),
    ({"env": 5}, "env must map names to strings"),  # not a mapping at all: no AttributeError
    ({"workdir": "tmp"}, "workdir must be absolute"),
    ({"user": "root"}, "user must be 'uid' or 'uid:gid'"),
    ({"ttl_s": -1}, "ttl_s must be positive"),
    ({"nofile": 0}, "nofile must be an int from 1 to 1048576"),
    ({"nofile": True}, "nofile must be an int"),
])
def test_sandbox_spec_names_the_bad_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SandboxSpec(**kwargs)


def test_sizes_and_equality():
    assert parse_bytes("512Mi") == 512 * 2 ** 20 and parse_bytes("1G") == 10 ** 9
    assert SandboxSpec(image="host", memory="1Gi").memory == 2 ** 30
    assert SandboxSpec.of("host") == SandboxSpec(image="host")
    assert hash(SandboxSpec(image="host", env={"A": "1"})) == hash(SandboxSpec(image="host", env={"A": "1"}))


@pytest.mark.parametrize("kwargs, words", [
    ({"reuse": "keep"}, "reuse must be 'reset' or 'delete'"),
    ({"pause_between_steps": "yes"}, "pause_between_steps must be True or False"),
    ({"max_sandboxes": 0}, "max_sandboxes must be a positive int"),
    ({"create_rate_per_s": 0}, "create_rate_per_s must be a positive"),
    ({"warm": {"host": -1}}, "warm counts must be ints >= 0"),
    ({"warm": {"host": 300}}, "more than max_sandboxes"),
    ({"client_quota": 1.5}, "client_quota must be a positive int"),
    ({"idle_timeout_s": 1}, "idle_timeout_s must be at least 5 s"),
    ({"default_nofile": 0}, "default_nofile must be a positive int"),
    ({"default_nofile": 2 ** 21}, "default_nofile must be at most 1048576"),
])
def test_pool_config_names_the_bad_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        PoolConfig(**kwargs)


def test_pool_config_turns_image_strings_into_specs():
    assert PoolConfig(warm={"host": 2}).warm == {
        SandboxSpec(image="host", pids=4096, memory="4Gi", disk="4Gi", nofile=4096): 2}


def test_pool_defaults_fill_only_the_limits_a_spec_leaves_open():
    config = PoolConfig(default_pids=100, default_memory="1Gi", default_disk=None)
    spec = config.limited(SandboxSpec(image="host", pids=7))
    assert (spec.pids, spec.memory, spec.disk, spec.nofile) == (7, 2 ** 30, None, 4096)
    assert PoolConfig(default_nofile=64).limited(SandboxSpec(nofile=9)).nofile == 9
    with pytest.raises(ValueError, match="default_memory"):
        PoolConfig(default_memory="lots")


@pytest.mark.parametrize("name", ["a/b", "", "-lead", "x" * 64, "sp ace", "dots/../up", 7, None])
def test_bad_pool_names_are_refused_by_name(name):
    from sandman_ray import create_pool
    from sandman_ray.providers.local import LocalProvider
    for attempt in (lambda: check_pool_name(name), lambda: create_pool(name),
                    lambda: LocalProvider().bind(name)):
        with pytest.raises(ValueError, match="pool name"):
            attempt()


def test_good_pool_names_pass():
    for name in ("default", "rl-rollout", "p.1_x", "x" * 63, "7up"):
        assert check_pool_name(name) == name
