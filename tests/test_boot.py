"""Boot phases: every phase is timed and reported, and a phase that runs past --boot-timeout is
logged at ERROR with its name and stack, then stopped with an error naming the remedy."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kiln.boot.phases import BootPhases, BootTimeoutError
from kiln.config.engine import EngineConfig
from kiln.errors import ConfigError

PHASES = ["load_model", "plan", "measure_graph_memory", "allocate_kv_cache", "warm_up"]


def _spin_until(deadline: float) -> None:
    """A hang in Python code: the watchdog's interrupt must end it long before the deadline."""
    while time.monotonic() < deadline:
        pass


def test_a_phase_past_its_limit_is_logged_and_stopped(caplog):
    boot = BootPhases(timeout_s=0.3)
    with boot.phase("quick"):
        pass
    start = time.monotonic()
    timed_out = pytest.raises(BootTimeoutError, match=r"'spin'.*0\.3 s")
    with caplog.at_level(logging.ERROR), timed_out, boot.phase("spin"):
        _spin_until(start + 60)
    assert time.monotonic() - start < 30
    error = next(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert "boot phase 'spin'" in error and "--boot-timeout" in error
    assert "_spin_until" in error  # where the booting thread was
    assert set(boot.durations) == {"quick", "spin"} and boot.durations["spin"] >= 0.3


def test_a_phase_on_another_thread_is_stopped_there(caplog):
    """The server boots on its engine thread: the watchdog must stop that thread, not main."""
    boot, raised = BootPhases(timeout_s=0.3), []

    def booting() -> None:
        try:
            with boot.phase("spin"):
                _spin_until(time.monotonic() + 60)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=booting)
    start = time.monotonic()
    with caplog.at_level(logging.ERROR):
        thread.start()
        thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - start < 30
    assert len(raised) == 1 and isinstance(raised[0], BootTimeoutError)
    assert any("_spin_until" in r.getMessage() for r in caplog.records)


def test_a_real_interrupt_is_not_a_timeout():
    boot = BootPhases(timeout_s=60)
    with pytest.raises(KeyboardInterrupt), boot.phase("interrupted"):
        raise KeyboardInterrupt
    with BootPhases(timeout_s=0).phase("unlimited"):  # 0: no watchdog at all
        pass


def test_engine_reports_every_phase(tiny_models):
    from kiln import LLM

    llm = LLM(tiny_models["llama"], kv_cache_memory="16MiB", boot_timeout=120)
    boot = llm.engine.boot
    assert list(PHASES) == list(boot.phases_s)[: len(PHASES)]
    assert boot.boot_s >= sum(boot.phases_s.values()) > 0
    with pytest.raises(ConfigError, match="boot_timeout must be >= 0"):
        EngineConfig(boot_timeout=-1)
