"""The one rule for calling a pool's actor while Ray may be restarting it
(sandman_ray/pool_calls.py), over plain data: no Ray runs here. A fake actor answers
each attempt with a value or with the error Ray would raise, and a driver that stands
in for ``carried`` plays the plan out, counting the waits it asks for."""

import time

import pytest
import ray.exceptions

from sandman_ray.pool_calls import ATTEMPTS, asking, restart_wait


class Actor:
    """Answers attempts in turn from ``answers`` (an exception is raised)."""

    def __init__(self, name, answers):
        self.name, self.answers, self.asked = name, list(answers), 0


def play(plan):
    """The plan's value (or its error) and the waits it asked for."""
    waits = []
    step = next(plan)
    while True:
        if isinstance(step, float):
            waits.append(step)
            outcome = None
        else:
            actor = step
            actor.asked += 1
            answer = actor.answers.pop(0)
            outcome = (False, answer) if isinstance(answer, BaseException) else (True, answer)
        try:
            step = plan.send(outcome)
        except StopIteration as done:
            return done.value, waits


def unavailable():
    return ray.exceptions.ActorUnavailableError("restarting", None)


def test_an_unavailable_pool_is_asked_again_after_growing_waits():
    actor = Actor("a", [unavailable(), unavailable(), "leased"])
    value, waits = play(asking(lambda a: a, actor, lambda dead: None))
    assert value == "leased" and actor.asked == 3
    assert waits == [restart_wait(0), restart_wait(1)] and waits[0] < waits[1]


def test_a_pool_that_stays_unavailable_is_given_up_after_the_attempts():
    actor = Actor("a", [unavailable() for _ in range(ATTEMPTS)])
    with pytest.raises(ray.exceptions.ActorUnavailableError):
        play(asking(lambda a: a, actor, lambda dead: None))
    assert actor.asked == ATTEMPTS


def test_no_attempt_after_the_deadline():
    actor = Actor("a", [unavailable(), "late"])
    with pytest.raises(ray.exceptions.ActorUnavailableError):
        play(asking(lambda a: a, actor, lambda dead: None, deadline=time.monotonic() - 1))
    assert actor.asked == 1


def test_a_dead_pool_is_looked_up_once_more_and_asked_there():
    old, new = Actor("old", [ray.exceptions.ActorDiedError()]), Actor("new", ["released"])
    value, waits = play(asking(lambda a: a, old, lambda dead: new if dead is old else None))
    assert value == "released" and (old.asked, new.asked) == (1, 1) and waits == []


def test_a_dead_pool_with_no_other_is_the_calls_error():
    old = Actor("old", [ray.exceptions.ActorDiedError()])
    with pytest.raises(ray.exceptions.ActorDiedError):
        play(asking(lambda a: a, old, lambda dead: None))


def test_a_pool_found_dead_twice_is_not_looked_up_a_third_time():
    old = Actor("old", [ray.exceptions.ActorDiedError()])
    new = Actor("new", [ray.exceptions.ActorDiedError()])
    with pytest.raises(ray.exceptions.ActorDiedError):
        play(asking(lambda a: a, old, lambda dead: new))
    assert (old.asked, new.asked) == (1, 1)


def test_the_pools_own_error_is_raised_as_it_is():
    actor = Actor("a", [ValueError("no such lease")])
    with pytest.raises(ValueError, match="no such lease"):
        play(asking(lambda a: a, actor, lambda dead: None))
    assert actor.asked == 1
