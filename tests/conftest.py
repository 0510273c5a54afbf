import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Tiny models: one torch thread is as fast, and immune to other busy processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------ the `distributed` marker
_SPAWNS = ("run_world(", "local_torchrun(", "torch.distributed.run", '"--nproc"', "'--nproc'")


def _spawns(fn, depth: int = 2) -> bool:
    """Does `fn` (or a module-level function it names, `depth` levels down) start a process
    group: a gloo world of spawned processes or torchrun workers?"""
    import inspect

    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if any(s in src for s in _SPAWNS):
        return True
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    return depth > 0 and code is not None and any(
        inspect.isfunction(scope.get(n)) and _spawns(scope[n], depth - 1) for n in code.co_names)


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: starts a process group (spawned gloo ranks or torchrun "
                                       "workers); `-m 'not distributed'` runs the rest")


def pytest_collection_modifyitems(config, items):
    for item in items:
        fns = [getattr(item, "function", None)]
        for defs in getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).values():
            fns += [d.func for d in defs]
        if any(f is not None and _spawns(f) for f in fns):
            item.add_marker(pytest.mark.distributed)
