"""Where each test's time goes: a pytest plugin, loaded only when asked for.

    .venv/bin/python -m pytest -p tests.timing_plugin --test-times times.jsonl
    .venv/bin/python scripts/test_times.py times.jsonl --top 60

writes one JSON object per test (setup, call and teardown together):

- ``wall``: seconds of wall time; ``setup``: of which in fixtures' setup (a module's server, the
  real model loaded once);
- ``trace``, ``lower``, ``compile``: seconds JAX spent in this process tracing functions to jaxprs,
  lowering them to StableHLO, and in XLA's backend (a compile, or a read from the persistent
  compilation cache: ``cache_read`` of it, over ``cache_hits`` executables; ``compiles`` counts the
  misses). From JAX's own monitoring events (``jax._src.monitoring``); nested jits count once per
  level, so ``trace`` is an upper bound;
- ``load``: seconds in `medusa_jax.convert.load.load_model` (in this process);
- ``children_cpu``: CPU seconds of the processes the test started and waited for (the CLI, a
  server, tests/mesh/'s pytest): a subprocess test's time is mostly spent waiting on them;
- ``cpu``: this process's own CPU seconds; ``markers``: the test's marks.

Under pytest-xdist each worker appends to the same file (one line per test, written whole).
"""
from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict

import pytest

_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile",
           "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read"}
_current: dict = defaultdict(float)


def pytest_addoption(parser):
    parser.addoption("--test-times", metavar="FILE", default=None,
                     help="append each test's time, split by where it went, to FILE (JSON lines)")


def pytest_configure(config):
    if not config.getoption("--test-times"):
        return
    from jax._src import monitoring

    def on_duration(event, duration, **_):
        if event in _EVENTS:
            _current[_EVENTS[event]] += duration
            if event == "/jax/compilation_cache/cache_retrieval_time_sec":
                _current["cache_hits"] += 1

    def on_event(event, **_):
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            _current["compiles"] += 1  # requests; hits are taken off at the end

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    _time_model_loads()


def _time_model_loads():
    """Wrap `load_model` before any test module imports it by name."""
    from medusa_jax.convert import load

    original = load.load_model

    def load_model(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _current["load"] += time.perf_counter() - t

    load.load_model = load_model
    import medusa_jax
    import medusa_jax.convert
    for module in (medusa_jax, medusa_jax.convert):
        if getattr(module, "load_model", None) is original:
            module.load_model = load_model


def _cpu(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--test-times")
    if not path:
        yield
        return
    _current.clear()
    t0, cpu0, kids0 = time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    rec = {"test": item.nodeid, "wall": time.perf_counter() - t0, "cpu": _cpu(resource.RUSAGE_SELF) - cpu0,
           "children_cpu": _cpu(resource.RUSAGE_CHILDREN) - kids0,
           "markers": sorted({m.name for m in item.iter_markers()} - {"parametrize", "usefixtures"}),
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    rec.update({k: round(v, 3) for k, v in _current.items()})
    rec["compiles"] = int(rec.get("compiles", 0) - rec.get("cache_hits", 0))
    rec["setup"] = round(_current.get("setup", 0.0), 3)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    t = time.perf_counter()
    yield
    _current["setup"] += time.perf_counter() - t
