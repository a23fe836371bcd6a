# make demo: set up and run the main example.  make test: set up and run every test.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# one stamp per extra: make demo installs what the example needs, make test also
# RLlib, a CPU build of torch and the agent frameworks of sandman_ray.integrations
STAMP = $(VENV)/.installed-$(1)
# make test's extras in one pip run, so that one resolver sees all their pins
TEST_STAMP := $(VENV)/.installed-test,integrations
# What the running code needs from Debian: bwrap for sandboxes, a static busybox for the
# smallest test image, patchelf and binutils (strip) for the daemon bundle, util-linux
# (unshare, nsenter, prlimit, mount) around sandboxes, slirp4netns, nftables and iproute2
# (the filter and the tap device) for the outbound network of sandboxes that ask for one,
# runsc (gVisor) for LocalProvider(isolation=
# "gvisor"), skopeo and umoci for images, debootstrap for the
# Debian test image, podman, runc and iptables (netavark's port publishing) for the
# DockerProvider's engine (Podman's Docker API service; the tests start their own),
# docker-registry for the tests' pulls, chromium for the test that looks at the Ray
# dashboard, gcc and libc6-dev for the escape suite's probe (a static program that runs in
# any image). Podman's user "containers" gets subordinate ids for the DockerProvider's
# per-container user namespaces (tools/ensure-subids).
DEBIAN_PACKAGES := bubblewrap busybox-static patchelf binutils util-linux skopeo umoci debootstrap \
	slirp4netns nftables iproute2 runsc podman runc iptables golang-github-containers-common \
	docker-registry chromium gcc libc6-dev

.PHONY: demo test test-fast test-chaos bench docs system-packages clean

system-packages:
	@tools/ensure-debian-packages $(DEBIAN_PACKAGES)
	@tools/ensure-subids

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed-%: pyproject.toml $(VENV)/bin/python
	$(BIN)/pip install -q -e '.[$*]'
	touch $@

# The default image, builtin:debian (Debian 12 minbase with python3 and less, debootstrap
# from Debian's mirror), built once into the cache that the demo and the tests use, and
# again when sandman_ray/image_builders.py changes what it is made of.
BUILTIN := .cache/provider/images/.builtin-images
$(BUILTIN): sandman_ray/image_builders.py | system-packages $(call STAMP,examples)
	$(BIN)/python -m sandman_ray.images .cache/provider
	touch $@

demo: system-packages $(call STAMP,examples) $(BUILTIN)
	$(BIN)/python examples/rl_rollout/train.py

# The Debian minbase rootfs without Python that the DockerProvider's tests import as an
# image (debootstrap, ~20 s), built once with the test set-up as builtin:debian is
DEBIAN_MINBASE := .cache/images/debian-bookworm
$(DEBIAN_MINBASE)/etc/debian_version: | system-packages $(TEST_STAMP)
	$(BIN)/python -c 'import sys; from sandman_ray.image_builders import build_debian_rootfs; \
		build_debian_rootfs(sys.argv[1])' $(DEBIAN_MINBASE)

test: system-packages $(TEST_STAMP) $(BUILTIN) $(DEBIAN_MINBASE)/etc/debian_version
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests

# the inner loop, under 3 minutes here: the daemon, its codec and bundle, the pool's
# decisions over data, the spec, the import graph, and the escape suite's attacks on
# one sandbox at a time (no pool); make test before a commit
TEST_FAST := $(wildcard tests/test_daemon_*.py) tests/test_codec.py tests/test_bundle.py \
	tests/test_protocol_doc.py tests/test_op_table.py tests/test_imports.py tests/test_spec.py \
	tests/test_errors.py tests/test_python_versions.py tests/test_reconciler.py \
	tests/test_reconciler_keepalive.py tests/test_service_keys.py tests/test_service_relay.py \
	tests/test_service.py \
	tests/test_touches.py tests/test_pool_calls.py \
	tests/test_security.py tests/test_syscall_policy.py tests/test_cluster_configs.py \
	tests/test_dashboard.py tests/test_escape.py tests/test_escape_pools.py \
	tests/test_escape_renew.py tests/test_escape_network_filter.py
test-fast: system-packages $(TEST_STAMP) $(BUILTIN)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=5 $(TEST_FAST)

# the fault suite (bench/chaos.py), every scenario once, 5,000 cycles of the soak
# (bench/soak.py), and twenty network pools shut down in turn, as tests
test-chaos: system-packages $(call STAMP,test) $(BUILTIN)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "chaos or soak" tests/test_chaos.py \
		tests/test_soak.py tests/test_shutdown_leaves_nothing.py

# the isolation section measures this commit's levels beside those of BENCH_AGAINST (the
# last commit before the system call policy and the interface filter), in turns
BENCH_AGAINST ?= dd77782
bench: system-packages $(call STAMP,bench) $(BUILTIN)
	$(BIN)/python bench/run_all.py --isolation-against $(BENCH_AGAINST)

# the documentation site (mkdocs.yml) into site/, strictly: a broken link or reference
# fails it (make test builds it too, tests/test_docs.py); its performance table is made
# from bench/results/*.json by the benchmark suite's own code, which imports Ray
docs: $(call STAMP,docs)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) .cache build site *.egg-info
