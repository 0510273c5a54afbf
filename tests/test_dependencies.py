"""The library layer needs only torch, numpy and blake3: the application layer's packages
(typer, rich, TensorBoard, matplotlib, scikit-learn, mnist1d) are the ``rankwise[cli]`` extra."""

import subprocess
import sys
import textwrap

APP_ONLY = ("typer", "rich", "tensorboard", "matplotlib", "sklearn", "mnist1d", "click")

_BLOCK = textwrap.dedent(f"""
    import builtins, sys
    BLOCKED = {APP_ONLY!r}
    for name in BLOCKED:  # as if not installed: importing them raises ModuleNotFoundError
        sys.modules[name] = None
    TRIED = []  # imports of them by rankwise's own modules (even ones that catch the error)
    _import = builtins.__import__

    def _recording_import(name, globals=None, *args, **kwargs):
        if name.split(".")[0] in BLOCKED and (globals or {{}}).get("__name__", "").startswith("rankwise"):
            TRIED.append((globals["__name__"], name))
        return _import(name, globals, *args, **kwargs)

    builtins.__import__ = _recording_import
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_library_imports_and_trains_without_the_cli_extra():
    r = _run("""
        import torch
        import rankwise, rankwise.nn, rankwise.optim, rankwise.ode, rankwise.ckpt, rankwise.dist
        import rankwise.linalg
        from rankwise.train import fit, accuracy, CodedCheckpoints
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        rankwise.to_low_rank(model, rank=4)
        x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
        loop = fit(model, rankwise.SDLRT(model, 0.05, tau=0.1), x, y, epochs=2, batch_size=16)
        assert loop.global_step == 8, loop.global_step
        print("ok", accuracy(model, x, y))
        loaded = [m for m, v in sys.modules.items() if m.split(".")[0] in BLOCKED and v is not None]
        assert not loaded, loaded
        assert not TRIED, TRIED
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ok")


def test_missing_extra_is_named():
    r = _run("""
        from rankwise.data import load_digits
        try:
            load_digits()
        except ImportError as e:
            print(e)
        from rankwise.cli import main
        sys.exit(main(["--help"]))
    """)
    assert "load_digits needs the package 'sklearn'" in r.stdout and "rankwise[cli]" in r.stdout, r
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "rankwise[cli]" in r.stderr, r.stderr
