"""SandboxFusion's API on a real ``sandman serve`` (service/fusion.py): ``/run_code``
driven by plain HTTP, by the ``sandbox-fusion`` client package and by verl's own reward
functions (``verl.utils.reward_score.sandbox_fusion``), each pointed at the service by
one URL. Every program runs in a sandbox of builtin:code lent for it alone; when they
are done, no lease is left open."""

import base64
import concurrent.futures
import json
import urllib.error
import urllib.request

import pytest

from conftest import leased, wait_until
from sandman_ray.service.fusion_leases import KEPT_MAX_S
from test_service import http_call, serving

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fusion(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("fusion"), "--fusion-image", "builtin:code",
                 warm={"builtin:code": 4}) as service:
        service["endpoint"] = "%s/fusion/%s" % (service["url"], service["alice"])
        service["store"].set_tenant("alice", max_sandboxes=16)  # more requests wait for room
        yield service


def post(url: str, body, raw: bytes = None):
    """(status, the answer's JSON) of a POST of ``body`` as JSON (or ``raw`` bytes)."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def pool_leases(pool: str) -> int:
    """How many leases ``pool`` has lent so far."""
    import ray
    import sandman_ray as sandman
    return ray.get(sandman.get_pool(pool).status.remote())["stats"]["leases"]


def kept(fusion) -> list:
    """The lease ids the service holds for /run_code (as the pool knows them)."""
    import ray
    import sandman_ray as sandman
    from sandman_ray.service.host import service_name
    held = ray.get(sandman.get_pool(fusion["pool"]).held_by.remote(service_name(fusion["pool"])))
    return [lease.lease_id for lease in held if lease.lease_id.startswith("F-")]


def run(fusion, **body):
    status, answer = post(fusion["endpoint"] + "/run_code", body)
    assert status == 200, answer
    return answer


def test_each_language_compiles_runs_and_says_how_it_went(fusion):
    for language, code in (("python", "import sys; print(sys.stdin.read().upper())"),
                           ("bash", "read x; echo ${x^^}"),
                           ("c", '#include <stdio.h>\nint main(){char s[64]; scanf("%63s", s);'
                                 ' for(char*p=s;*p;p++) if(*p>=97) *p-=32; puts(s);}'),
                           ("cpp", "#include <iostream>\n#include <algorithm>\nint main(){"
                                   "std::string s; std::cin >> s; std::transform(s.begin(),"
                                   " s.end(), s.begin(), ::toupper); std::cout << s << '\\n';}")):
        answer = run(fusion, language=language, code=code, stdin="shout\n")
        assert answer["status"] == "Success", (language, answer)
        assert answer["run_result"]["stdout"].strip() == "SHOUT", (language, answer)
        assert answer["run_result"]["return_code"] == 0
        assert (answer["compile_result"] is not None) == (language in ("c", "cpp"))


def test_failures_are_told_apart_as_sandbox_fusion_does(fusion):
    broken = run(fusion, language="cpp", code="int main() { return }")
    assert broken["status"] == "Failed" and broken["run_result"] is None
    assert broken["compile_result"]["return_code"] != 0 and "error" in \
        broken["compile_result"]["stderr"]
    raised = run(fusion, language="python", code="raise SystemExit(3)")
    assert raised["status"] == "Failed" and raised["run_result"]["return_code"] == 3
    slow = run(fusion, language="python", code="import time; time.sleep(30)", run_timeout=1)
    assert slow["status"] == "Failed"
    assert slow["run_result"]["status"] == "TimeLimitExceeded"
    assert 1 <= slow["run_result"]["execution_time"] < 10
    greedy = run(fusion, language="python", code="x = bytearray(400 << 20); print('held')",
                 memory_limit_MB=128)
    assert greedy["status"] == "Failed" and "MemoryError" in greedy["run_result"]["stderr"]


def test_files_go_in_and_come_back(fusion):
    answer = run(fusion, language="bash", code="cat data/in.txt | rev > out.txt",
                 files={"data/in.txt": base64.b64encode(b"olleh\n").decode()},
                 fetch_files=["out.txt", "never-made.txt"])
    assert answer["status"] == "Success", answer
    assert answer["files"] == {"out.txt": base64.b64encode(b"hello\n").decode()}
    # what is fetched is bounded in all (the service holds it to answer), a name once
    big = run(fusion, language="bash", code="head -c 17M /dev/zero > big; echo hi > small",
              fetch_files=["small", "big", "./big", "small"])
    assert big["files"] == {"small": base64.b64encode(b"hi\n").decode()}
    assert "at most" in big["message"]


def test_a_program_never_sees_the_last_ones_files(fusion):
    """Each request gets a sandbox lent for it alone and reset before it is lent again."""
    for _ in range(6):  # more than the warm pool: some of the sandboxes are used twice
        answer = run(fusion, language="bash",
                     code="ls /tmp/fusion/left-behind 2>/dev/null; touch /tmp/fusion/left-behind")
        assert answer["status"] == "Success" and answer["run_result"]["stdout"] == ""


def test_a_tenants_kept_sandboxes_serve_program_after_program_renewed(fusion):
    """The service keeps the sandboxes of a tenant's requests and has its node's agent
    renew each one after its program (service/fusion_leases.py): a sandbox serves
    request after request, and no program finds a file or a process of any before it.
    The tenant never sees those leases, and once idle they go back to the pool."""
    from sandman_ray.remote import connect
    code = ("hostname; ls /tmp/fusion/left /root/left 2>/dev/null; grep -lx sleep "
            "/proc/*/comm; echo x > /tmp/fusion/left; echo x > /root/left; "
            "setsid sleep 1000 > /dev/null 2>&1 &")
    seen, lent = [], pool_leases(fusion["pool"])
    for _ in range(8):
        name, *rest = run(fusion, language="bash", code=code)["run_result"]["stdout"].split("\n")
        assert rest == [""], rest  # nothing of the programs before
        seen.append(name)
    assert len(set(seen)) < len(seen), seen  # sandboxes that served more than one
    assert pool_leases(fusion["pool"]) - lent < len(seen)  # not each lent by the pool
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(run, fusion, language="bash", code="sleep 3; echo done")
        wait_until(lambda: kept(fusion), timeout=30)
        assert connect(fusion["url"], fusion["alice"]).leases() == []
        for lease_id in kept(fusion):  # its id known (guessed): still none of hers
            for key in (fusion["alice"], fusion["bob"]):
                for method, path, body in (("GET", "", None), ("POST", "/keepalive", None),
                                           ("POST", "/pause", {}), ("DELETE", "", None)):
                    status, _, _ = http_call(fusion, method, "/v1/leases/%s%s" % (lease_id, path),
                                             body, key=key)
                    assert status == 404, (method, path, status)
                status, _, answer = http_call(fusion, "POST", "/v1/keepalive",
                                              {"leases": [lease_id]}, key=key)
                assert status == 200 and json.loads(answer)["ended"] == [lease_id], answer
        assert slow.result()["run_result"]["stdout"] == "done\n"
    wait_until(lambda: leased(fusion["pool"]) == 0, timeout=30)


def test_refusals_have_sandbox_fusions_shape(fusion):
    status, answer = post(fusion["endpoint"] + "/run_code", {"code": "1", "language": "cobol"})
    assert status == 422 and answer["detail"][0]["loc"] == ["body", "language"]
    status, answer = post(fusion["endpoint"] + "/run_code", {"language": "python"})
    assert status == 422 and answer["detail"][0]["loc"] == ["body", "code"]
    status, answer = post(fusion["endpoint"] + "/run_code", None, raw=b"{nope")
    assert status == 422 and isinstance(answer["detail"], list)
    status, answer = post(fusion["endpoint"] + "/run_code",
                          {"code": "x" * (9 << 20), "language": "python"})
    assert status == 413 and isinstance(answer["detail"], str)
    status, answer = post("%s/fusion/%s/run_code" % (fusion["url"], "sk_sandman_" + "0" * 40),
                          {"code": "print(1)", "language": "python"})
    assert status == 401 and isinstance(answer["detail"], str)
    with urllib.request.urlopen(fusion["endpoint"] + "/v1/ping", timeout=30) as answer:
        assert answer.read() == b"pong"


def test_the_sandbox_fusion_client_package_runs_code(fusion):
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code, set_endpoint
    set_endpoint(fusion["endpoint"])
    answer = run_code(RunCodeRequest(code="print(6 * 7)", language="python"))
    assert answer.status == RunStatus.Success and answer.run_result.stdout == "42\n"


def test_verls_reward_functions_score_through_sandman(fusion):
    """verl's check_correctness and compute_score, unchanged, with the service's URL: a
    right answer, a wrong one, a compile error, a runtime error and a timeout, told
    apart as verl tells them (True, False, -4, -2, -3)."""
    from verl.utils.reward_score.sandbox_fusion import compute_score
    from verl.utils.reward_score.sandbox_fusion.utils import check_correctness
    url = fusion["endpoint"] + "/run_code"
    cases = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
    right = "a, b = map(int, input().split()); print(a + b)"
    assert check_correctness(url, cases, right, timeout=5)[0] == [True, True]
    assert check_correctness(url, cases, right.replace("+", "*"), timeout=5)[0] == [False, False]
    cpp = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    assert check_correctness(url, cpp, "int main( {", timeout=5, language="cpp")[0] == [-4]
    assert check_correctness(url, cpp, "print(1/0)", timeout=5)[0] == [-2]
    assert check_correctness(url, cpp, "while True: pass", timeout=1)[0] == [-3]
    score, _ = compute_score(url, None, 1024, "```python\n%s\n```" % right, cases)
    assert score == 1.0


def test_a_grpo_batch_of_rewards_leaves_no_lease_open(fusion):
    """64 rollouts scored at once (check_correctness of 8 test cases each, as a GRPO step
    does): every verdict right, and when they are done, no lease is left open and the
    pool lends nothing."""
    from verl.utils.reward_score.sandbox_fusion.utils import check_correctness
    from sandman_ray.remote import connect
    url = fusion["endpoint"] + "/run_code"
    cases = {"inputs": ["%d\n" % i for i in range(8)],
             "outputs": ["%d\n" % (i * i) for i in range(8)]}
    programs = ["n = int(input()); print(n * n)" if i % 2 else "n = int(input()); print(n + n)"
                for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda p: check_correctness(url, cases, p, timeout=10),
                                programs))
    for i, (result, metadata) in enumerate(answers):  # (metadata: what went wrong, if)
        assert result == ([True] * 8 if i % 2 else [n * n == n + n for n in range(8)]), \
            (i, result, [m for m, r in zip(metadata, result) if r is not True and r is not False])
    assert connect(fusion["url"], fusion["alice"]).leases() == []
    wait_until(lambda: leased(fusion["pool"]) == 0, timeout=30)


def test_a_request_that_finds_no_room_within_its_timeouts_answers_504(fusion):
    """carol may hold one sandbox at a time. While a slow program holds it, a request
    whose compile and run timeouts together end before a sandbox frees up answers 504,
    a gateway's timeout, which verl's client retries (it takes any other refusal as
    the program's failure), and the slow program still runs to its end."""
    endpoint = "%s/fusion/%s/run_code" % (fusion["url"], fusion["carol"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, endpoint, {"code": "import time; time.sleep(6); print('done')",
                                            "language": "python", "run_timeout": 20})
        wait_until(lambda: leased(fusion["pool"]) == 1, timeout=30)
        status, answer = post(endpoint, {"code": "print(1)", "language": "python",
                                         "compile_timeout": 0.5, "run_timeout": 0.5})
        assert status == 504, answer
        assert "no sandbox was free" in answer["detail"] and "try again" in answer["detail"]
        status, done = slow.result()
    assert status == 200 and done["run_result"]["stdout"] == "done\n", done
    wait_until(lambda: leased(fusion["pool"]) == 0, timeout=30)


def test_a_tenants_own_acquire_takes_the_room_of_its_kept_sandbox(fusion):
    """carol may hold one sandbox. The one the service keeps for her requests (idle, or
    still being renewed just after her program's answer) gives way to her own acquire
    rather than refuse it for her limit."""
    from sandman_ray.remote import connect
    endpoint = "%s/fusion/%s/run_code" % (fusion["url"], fusion["carol"])
    status, answer = post(endpoint, {"code": "print(1)", "language": "python"})
    assert status == 200 and answer["run_result"]["stdout"] == "1\n", answer
    with connect(fusion["url"], fusion["carol"]).sandbox("builtin:code", timeout=60) as sb:
        assert sb.exec("echo mine").stdout == b"mine\n"
    wait_until(lambda: leased(fusion["pool"]) == 0, timeout=30)


def test_kept_sandboxes_go_back_to_the_pool_while_another_tenant_waits(tmp_path):
    """A pool at its size, all of it kept for alice's stream of /run_code requests: bob's
    acquire waits at the pool, and the service gives alice's sandboxes back to the pool
    (which lends by its fair queue) instead of renewing them for her, so bob gets one
    while her stream goes on, long before a kept lease's age would return it."""
    import threading
    from sandman_ray.remote import connect
    with serving(tmp_path, "--fusion-image", "builtin:code", warm={"builtin:code": 2},
                 max_sandboxes=2) as service:
        endpoint = "%s/fusion/%s/run_code" % (service["url"], service["alice"])
        stop, answers = threading.Event(), []

        def stream() -> None:
            while not stop.is_set():
                answers.append(post(endpoint, {"code": "print(1)", "language": "python"}))
        threads = [threading.Thread(target=stream) for _ in range(3)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: len(kept(service)) == 2, timeout=60)
            bob = connect(service["url"], service["bob"])
            with bob.sandbox("builtin:code", timeout=KEPT_MAX_S / 2) as sb:
                assert sb.exec("echo bob").stdout == b"bob\n"
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert answers and all(status == 200 for status, _ in answers)
