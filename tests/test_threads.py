"""caramba.threads: the thread count comes from the cores actually free, CARAMBA_THREADS wins, and
the Generator runs its prefill and steps on the choice. The contention tests start a real busy
process pinned to one core (caramba.bench.busy) and check the chosen count, never a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from caramba import threads
from caramba.bench.busy import busy_core
from caramba.errors import UserError
from caramba.infer.config import GenerateConfig
from caramba.infer.generate import Generator
from caramba.model import fast_decode
from conftest import make_model

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="a busy core needs a second CPU to leave free")


@pytest.fixture
def all_cores(monkeypatch):
    """torch's ceiling at every CPU of the affinity (the unit tests' fixture set it to 1), no
    CARAMBA_THREADS, no remembered choice."""
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_last", None)
    before = torch.get_num_threads()
    torch.set_num_threads(len(CPUS))
    yield len(CPUS)
    torch.set_num_threads(before)


@needs_two
def test_a_busy_core_takes_a_thread_off_the_choice(all_cores):
    with busy_core(CPUS[-1]) as cpu:
        choice = threads.choose(max_age=0)
    assert choice.source == "free cores" and choice.asked == all_cores
    assert choice.used <= all_cores - 1           # whatever else the machine runs, that core is not free
    assert choice.idle[choice.cpus.index(cpu)] < 0.5 and choice.free_cores <= all_cores - 0.5
    assert threads.last() is choice and threads.record()["used"] == choice.used


@needs_two
def test_caramba_threads_wins_over_a_busy_core(all_cores, monkeypatch):
    monkeypatch.setenv(threads.ENV, str(all_cores))
    with busy_core(CPUS[-1]):
        choice = threads.choose(max_age=0)
    assert (choice.used, choice.source) == (all_cores, threads.ENV)
    monkeypatch.setenv(threads.ENV, "auto")
    with busy_core(CPUS[-1]):
        assert threads.choose(max_age=0).used <= all_cores - 1


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_a_bad_caramba_threads_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(threads.ENV, raw)
    with pytest.raises(UserError, match="CARAMBA_THREADS must be a positive integer or .auto."):
        threads.choose()


def test_free_cores_round_up_from_three_quarters_and_respect_the_quota(all_cores, monkeypatch):
    """The rule on given samples: a core counts when it is at least FREE_AT idle (summed over the
    CPUs), never above torch's ceiling or a cgroup quota, never below one thread."""
    torch.set_num_threads(4)
    monkeypatch.setattr(threads, "cgroup_quota", lambda: None)
    for free, used in [(0.0, 1), (1.0, 1), (1.74, 1), (1.75, 2), (2.0, 2), (3.7, 3), (3.75, 4), (6.0, 4)]:
        monkeypatch.setattr(threads, "sample", lambda free=free: ((0, 1, 2, 3), (free / 4,) * 4, free))
        assert threads.choose(max_age=0).used == used, free
    monkeypatch.setattr(threads, "cgroup_quota", lambda: 1.5)
    assert threads.choose(max_age=0).used == 1
    assert "cgroup quota 1.5" in threads.last().why


def test_a_young_choice_is_reused_and_a_changed_ceiling_samples_again(all_cores, monkeypatch):
    calls = []
    monkeypatch.setattr(threads, "sample", lambda: calls.append(1) or ((0,), (1.0,), 1.0))
    first = threads.choose()
    assert threads.choose() is first and len(calls) == 1
    torch.set_num_threads(all_cores + 1)
    assert threads.choose() is not first and len(calls) == 2


def test_the_generator_runs_on_the_choice_and_restores_torchs_count(monkeypatch):
    """CARAMBA_THREADS=1 with torch at 2: prefill and steps run on one thread (torch's count and
    the C step's), and torch's count is back afterwards."""
    monkeypatch.setenv(threads.ENV, "1")
    torch.set_num_threads(2)
    model = make_model()
    gen = Generator(model, GenerateConfig(max_new_tokens=4, min_new_tokens=4))
    seen = []
    gen.run([[1, 2, 3]], on_token=lambda row, tok: seen.append(torch.get_num_threads()))
    assert seen == [1] * 4 and torch.get_num_threads() == 2
    assert gen.threads.used == 1 and gen.threads.source == threads.ENV
    monkeypatch.setenv(threads.ENV, "2")
    assert gen._cpu_threads() is gen.threads          # once per session; reset() chooses again
    gen.reset()
    assert gen._cpu_threads().used == 2


def test_caramba_threads_pins_the_steps_thread_choice(monkeypatch):
    monkeypatch.setenv(threads.ENV, "2")
    torch.set_num_threads(1)
    choice = fast_decode.ThreadChoice()
    for _ in range(40):
        n = choice.next()
        assert n == 2
        choice.took(n, 1.0 if n == 2 else 0.01)       # one thread "faster": a pin does not move


def test_env_json_records_the_choice_and_the_wait_bound():
    from caramba.runs import capture_env

    env = json.loads(json.dumps(capture_env(None, "cpu")))
    assert env["threads"]["used"] >= 1 and env["threads"]["why"]
    assert "set_by" in env["threads"]["wait"]


def _wait_in_child(code: str, **env: str) -> dict:
    child_env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env={**child_env, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout)


def test_the_wait_bound_is_set_before_libgomp_loads_and_a_users_policy_wins():
    show = "import json, os; from caramba import threads; print(json.dumps({**threads.bound_spinning(), 'env': os.environ.get('GOMP_SPINCOUNT')}))"
    mine = _wait_in_child("import caramba, torch; " + show)
    assert mine == {"GOMP_SPINCOUNT": threads.SPINCOUNT, "set_by": "caramba", "env": threads.SPINCOUNT}
    users = _wait_in_child("import caramba, torch; " + show, OMP_WAIT_POLICY="active")
    assert users["set_by"] == "user" and users["OMP_WAIT_POLICY"] == "active" and users["env"] is None
    late = _wait_in_child("import torch, caramba; " + show)
    assert late["set_by"].startswith("nobody") and late["env"] is None
