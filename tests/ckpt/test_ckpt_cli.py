"""`rankwise ckpt` end to end: encode, lose and corrupt workers, verify, repair, retrieve."""

import random

from helpers import run_cli


def test_encode_lose_repair_retrieve(tmp_path):
    data = random.Random(5).randbytes(50_000)
    (tmp_path / "ck.bin").write_bytes(data)
    folder = tmp_path / "d"
    r = run_cli(*["ckpt", "encode", str(tmp_path / "ck.bin"), "--n", "7", "--t", "2",
                            "--out", str(folder)])
    assert r.exit_code == 0, r.output
    expected = ["commitment.rwck"] + [f"worker{i}.rwck" for i in range(7)]
    assert sorted(p.name for p in folder.iterdir()) == expected
    (folder / "worker6.rwck").unlink()  # a lost parity worker
    blob = bytearray((folder / "worker1.rwck").read_bytes())
    blob[100] ^= 1  # a corrupted systematic worker
    (folder / "worker1.rwck").write_bytes(bytes(blob))
    r = run_cli(*["ckpt", "verify", str(folder)])
    assert r.exit_code == 1 and "missing" in r.output and "does not match the commitment" in r.output
    for w in (6, 1):
        r = run_cli(*["ckpt", "repair", str(folder), "--worker", str(w)])
        assert r.exit_code == 0, r.output
        assert "read 20,000 payload bytes" in r.output.replace("\n", " ")  # 2·k·B = 2·5·2000
    assert run_cli(*["ckpt", "verify", str(folder)]).exit_code == 0
    r = run_cli(*["ckpt", "retrieve", str(folder), "--out", str(tmp_path / "out.bin")])
    assert r.exit_code == 0 and (tmp_path / "out.bin").read_bytes() == data


def test_clear_errors(tmp_path):
    (tmp_path / "x").write_bytes(b"abc")
    r = run_cli(*["ckpt", "encode", str(tmp_path / "x"), "--n", "3", "--t", "1",
                            "--out", str(tmp_path)])
    assert r.exit_code == 2 and "3t < n" in r.output
    r = run_cli(*["ckpt", "verify", str(tmp_path)])
    assert r.exit_code == 1 and "no commitment.rwck" in r.output


def test_rewritten_or_forged_commitment_is_refused(tmp_path):
    """A header field rewritten and re-sealed (root kept) is refused in one line; a commitment
    forged whole (root recomputed) is refused by `retrieve --root` with the root `encode` printed."""
    from rankwise.ckpt import Code2D, read_commitment
    from rankwise.ckpt._format import Commitment, commitment_root

    data = random.Random(6).randbytes(10_001)  # data_len − 1 keeps the block size (⌈·/9⌉ = 1112)
    (tmp_path / "ck.bin").write_bytes(data)
    folder = tmp_path / "d"
    r = run_cli("ckpt", "encode", tmp_path / "ck.bin", "--n", "4", "--t", "1", "--out", folder)
    root = r.output.replace("\n", "").split("commitment root ")[1].split(" ")[0]
    com = read_commitment(folder / "commitment.rwck")
    assert root == com.root.hex()
    pristine = (folder / "commitment.rwck").read_bytes()
    fields = {f: getattr(com, f) for f in ("n", "t", "block_size", "hash", "codec", "line_roots", "version")}
    fields["data_len"] = com.data_len - 1  # the output would lose its last byte
    kept = Commitment(**{k: v for k, v in fields.items() if k != "version"}, root=com.root)
    (folder / "commitment.rwck").write_bytes(kept.to_bytes())
    r = run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "a.bin")
    assert r.exit_code == 1 and "do not hash to its root" in r.stderr and not (tmp_path / "a.bin").exists()
    forged_root = commitment_root(Code2D(4, 1)._h, **fields)
    forged = Commitment(**{k: v for k, v in fields.items() if k != "version"}, root=forged_root)
    (folder / "commitment.rwck").write_bytes(forged.to_bytes())
    r = run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "b.bin", "--root", root)
    assert r.exit_code == 1 and "not the --root given" in r.stderr and not (tmp_path / "b.bin").exists()
    for command in (("verify",), ("inspect",), ("repair", "--worker", "1")):  # issue 49: --root for all
        r = run_cli("ckpt", *command, folder, "--root", root)
        assert r.exit_code == 1 and "not the --root given" in r.stderr, (command, r.stderr)
    r = run_cli("ckpt", "verify", folder, "--root", "12")
    assert r.exit_code == 2 and "64 hex digits" in r.stderr, r.stderr
    (folder / "commitment.rwck").write_bytes(pristine)
    assert run_cli("ckpt", "verify", folder, "--root", root).exit_code == 0
    r = run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "c.bin", "--root", root)
    assert r.exit_code == 0 and (tmp_path / "c.bin").read_bytes() == data


def test_a_folder_with_no_commitment_is_refused_before_torch_is_imported(tmp_path):
    import subprocess
    import sys

    from rankwise.ckpt._store import COMMITMENT_FILE
    from rankwise.cli._ckpt import COMMITMENT

    assert COMMITMENT == COMMITMENT_FILE
    code = ("import sys; from rankwise.cli import main; "
            "rcs = [main(['ckpt', *c.split(), sys.argv[1]]) for c in "
            "('verify', 'inspect', 'repair --worker 0', 'retrieve --out ' + sys.argv[1] + '/x.bin')]; "
            "print(rcs, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[1, 1, 1, 1] False"
    assert out.stderr.count(f"no commitment.rwck in {tmp_path}") == 4
    assert list(tmp_path.iterdir()) == []


def test_a_format_1_folder_is_refused_unless_the_user_says_it_is_not_tamper_evident(tmp_path):
    from test_byzantine import _reseal

    from rankwise.ckpt import Commitment, read_commitment

    data = random.Random(9).randbytes(20_000)
    (tmp_path / "ck.bin").write_bytes(data)
    folder = tmp_path / "d"
    r = run_cli("ckpt", "encode", str(tmp_path / "ck.bin"), "--n", "4", "--t", "1", "--out", str(folder))
    assert r.exit_code == 0
    com_path = folder / "commitment.rwck"
    v1 = Commitment.from_bytes(_reseal(read_commitment(com_path), version=1))
    k = 3
    short = (v1.block_size - 1) * k * k + 1  # the attack: data cut short, root kept
    com_path.write_bytes(_reseal(v1, data_len=short, keep_root=True))
    for args in (("verify",), ("retrieve", "--out", str(tmp_path / "out.bin")), ("repair", "--worker", "1")):
        r = run_cli("ckpt", *args[:1], str(folder), *args[1:])
        assert r.exit_code == 1 and "has format 1" in r.stderr and "--v1-not-tamper-evident" in r.stderr, r
    assert not (tmp_path / "out.bin").exists()
    r = run_cli("ckpt", "inspect", str(folder))
    assert r.exit_code == 0 and "not detected" in " ".join(r.stdout.split())
    r = run_cli("ckpt", "retrieve", str(folder), "--out", str(tmp_path / "out.bin"),
                "--v1-not-tamper-evident")
    assert r.exit_code == 0 and (tmp_path / "out.bin").read_bytes() == data[:short]  # what format 1 allows


def test_retrieve_compares_the_pinned_root_before_reading_any_worker_file(tmp_path, monkeypatch):
    """Issue 41, attack 5: a forged commitment with large worker files was refused only after
    every worker file was read and verified."""
    import rankwise.ckpt

    (tmp_path / "ck.bin").write_bytes(random.Random(7).randbytes(5_000))
    folder = tmp_path / "d"
    run_cli("ckpt", "encode", tmp_path / "ck.bin", "--n", "4", "--t", "1", "--out", folder)

    def no_reads(*a, **k):
        raise AssertionError("a worker file was read")

    monkeypatch.setattr(rankwise.ckpt, "load_fragments", no_reads)
    r = run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "a.bin", "--root", "ab" * 32)
    assert r.exit_code == 1 and "not the --root given" in r.stderr


def _save_step(rank: int, store: str):
    import torch

    from rankwise.ckpt import CodedCheckpointer

    CodedCheckpointer(t=1, store_dir=store).save({"w": torch.arange(3000.0)}, 10)


def test_a_checkpointer_step_folder_is_read_as_one_checkpoint(tmp_path):
    """Issue 41, newcomer round: `ckpt inspect`/`verify` on a `train --checkpoint-dir` step folder
    reported every worker missing and the data unrecoverable although it was intact."""
    import torch

    from distributed import run_world

    store = tmp_path / "store"
    run_world(_save_step, 4, tmp_path, str(store), timeout=120)
    step = store / "rank0" / "step_0000000010"
    r = run_cli("ckpt", "inspect", str(step))
    assert r.exit_code == 0 and "matching the commitment: [0, 1, 2, 3]" in r.output, r.output
    assert "problems: none" in r.output
    lost = store / "rank2" / "step_0000000010"
    for f in lost.iterdir():
        f.unlink()
    lost.rmdir()  # rank 2 lost its step folder
    r = run_cli("ckpt", "verify", str(step))
    assert r.exit_code == 1 and "missing" in r.output, r.output
    r = run_cli("ckpt", "repair", str(step), "--worker", "2")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in lost.iterdir()) == ["commitment.rwck", "fragment.rwck"]
    assert run_cli("ckpt", "verify", str(step)).exit_code == 0
    r = run_cli("ckpt", "retrieve", str(step), "--out", str(tmp_path / "blob"))
    assert r.exit_code == 0, r.output
    saved = torch.load(tmp_path / "blob", weights_only=True)
    assert torch.equal(saved["state"]["w"], torch.arange(3000.0))


def test_repair_into_a_step_folder_it_cannot_write_is_one_line(tmp_path):
    """The rank's step folder is a file: the repair names it and exits 1 (no internal error)."""
    from distributed import run_world

    store = tmp_path / "store"
    run_world(_save_step, 4, tmp_path, str(store), timeout=120)
    lost = store / "rank2" / "step_0000000010"
    for f in lost.iterdir():
        f.unlink()
    lost.rmdir()
    lost.write_text("not a folder")
    r = run_cli("ckpt", "repair", str(store / "rank0" / "step_0000000010"), "--worker", "2")
    assert r.exit_code == 1 and "internal error" not in r.stderr, r.stderr
    assert "cannot write worker 2's fragment" in r.stderr and "is not a folder" in r.stderr
    assert lost.read_text() == "not a folder"
