"""What a new user meets first: the commonest errors of the public API reach the caller
as the error they are (a SandmanError, or a ValueError for bad input), their message
first and without Ray's remote traceback; the actors name themselves for the Ray
dashboard; and a handle dropped after its pool's shutdown logs nothing as unhandled.
On a real local Ray with the LocalProvider."""

import pytest

import sandman_ray as sandman
from sandman_ray.errors import AcquireTimeout, LeaseEnded, ProviderError, SandmanError
from conftest import LOCAL_CACHE, LOCAL_STATE, local_ray, unique_pool


@pytest.fixture(scope="module")
def cluster():
    yield from local_ray()


@pytest.fixture(scope="module")
def pool(cluster):
    name = unique_pool(sandman.LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE),
                       "first")
    yield name
    sandman.shutdown_pool(name)


def plain(err: BaseException, starts: str) -> None:
    """``err``'s message is its own, first, with no traceback in it."""
    text = str(err)
    assert text.startswith(starts), text
    assert "Traceback" not in text and "ray::" not in text and "\x1b[" not in text, text


def test_an_image_that_does_not_exist(pool):
    with pytest.raises(ProviderError) as caught:
        sandman.acquire("dir:/no/such/image", pool=pool, timeout=30)
    plain(caught.value, "image 'dir:/no/such/image'")
    assert type(caught.value) is ProviderError  # not Ray's wrapper of it
    assert caught.value.__cause__ is None  # (SANDMAN_RAY_TRACEBACK=1 chains it)
    # Ray's error is kept, and names the pool's actor by what it is
    assert "PoolActor(pool=%s" % pool in str(caught.value.ray_error)


def test_an_image_reference_that_is_no_reference(pool):
    with pytest.raises(ValueError) as caught:
        sandman.acquire("no such::image", pool=pool, timeout=30)
    plain(caught.value, "image 'no such::image' is not builtin:debian, host, dir:/path")


def test_no_such_pool(cluster):
    with pytest.raises(SandmanError) as caught:
        sandman.acquire("builtin:debian", pool="no-such-pool", timeout=5)
    plain(caught.value, "no pool named 'no-such-pool': create it with "
                        "sandman_ray.create_pool('no-such-pool')")


def test_a_spec_field_that_does_not_exist(pool):
    with pytest.raises(ValueError) as caught:
        sandman.acquire({"image": "builtin:debian", "memroy": "1Gi"}, pool=pool, timeout=5)
    plain(caught.value, "SandboxSpec has no field memroy (did you mean memory?)")
    with pytest.raises(TypeError, match="a sandbox's spec is a SandboxSpec, an image "
                                        "string or a dict"):
        sandman.acquire(42, pool=pool, timeout=5)


def test_an_acquire_that_times_out(pool, busybox_image):
    with pytest.raises(AcquireTimeout) as caught:
        sandman.acquire(busybox_image, pool=pool, timeout=0.001)
    plain(caught.value, "pool %s: no %s sandbox within" % (pool, busybox_image))
    assert isinstance(caught.value, TimeoutError)


def test_a_call_on_a_lease_that_ended(pool, busybox_image):
    sb = sandman.acquire(busybox_image, pool=pool, timeout=60)
    sandman.release(sb)
    with pytest.raises(LeaseEnded) as caught:
        sb.exec("true")
    plain(caught.value, "lease %s has ended: released by its holder" % sb.lease_id)


def test_a_handle_released_after_its_pools_shutdown_raises_nothing(cluster, busybox_image):
    """A handle's release that reaches its host after the pool is gone (a handle
    dropped after ``shutdown_pool``: its finalizer's call has no one to answer) ends
    quietly, so Ray has no unhandled error to log: the lease ended with the pool."""
    import ray
    name = unique_pool(sandman.LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE),
                       "first-gone")
    sb = sandman.acquire(busybox_image, pool=name, timeout=60)
    assert ray.get(sb.exec.remote("true")).exit_code == 0  # its host holds the lease
    host = sb._host
    sandman.shutdown_pool(name)
    assert ray.get(host.release.remote(sb.lease_id, name)) in (True, False)
    assert ray.get(host.release.remote(sb.lease_id, name)) is False  # once more: nothing
