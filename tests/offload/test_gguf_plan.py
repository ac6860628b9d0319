"""A GGUF file planned from its header alone (nothing imported, nothing written), its weights' bytes as stored; a long
import's progress on a terminal; and an import stopped by SIGTERM or killed outright leaving nothing behind."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from test_gguf import HIDDEN, LAYERS, write_gguf

from offload.cli import main
from offload.common.errors import OffloadError
from offload.common.progress import Progress
from offload.convert.quantize import staged
from offload.convert.staging import STAGING_MARK, sweep_staged
from offload.gguf import importer as gguf_import
from offload.gguf.header import gguf_shape
from offload.gguf.importer import import_gguf
from offload.gguf.resolve import resolve_model
from offload.model.loader import load_spec

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 260  # test_gguf's tokenizer: 3 specials, 256 byte-level symbols, one merge
# test_gguf's layer matrices: q, o, gate, up, down [256, 256]; k, v [128, 256]
LAYER_WEIGHTS = 5 * HIDDEN * HIDDEN + 2 * 128 * HIDDEN
NORMS = (2 * LAYERS + 1) * HIDDEN  # float32: two a layer and the final one
# an import that stops inside its staged folder until a signal comes: the tokenizer is written there, last
STALLED_IMPORT = """
import sys, time
from pathlib import Path
from offload.gguf import importer

def stall(*args):
    print("writing", flush=True)
    time.sleep(120)

importer.write_tokenizer = stall
importer.import_gguf(Path(sys.argv[1]), Path(sys.argv[2]), "cpu")
"""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="module")
def q4_0_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf-plan") / "tiny.gguf"
    write_gguf(path)
    return path


@pytest.fixture(scope="module")
def q4_k_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file of Q4_K blocks, which do not run in place: the engine imports it."""
    path = tmp_path_factory.mktemp("gguf-plan") / "tiny-q4k.gguf"
    write_gguf(path, qtype=T.Q4_K)
    return path


def test_a_gguf_file_is_planned_from_its_header_and_nothing_is_written(
    capsys, tmp_path: Path, empty_cache: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "model" / "tiny.gguf"
    path.parent.mkdir()
    write_gguf(path)
    monkeypatch.setattr(gguf_import, "import_gguf", lambda *a: pytest.fail("`offload plan` imported the file"))
    argv = ["plan", "--model", str(path), "--hardware", "h100-80gb"]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    q4_0 = LAYERS * LAYER_WEIGHTS * 18 // 32  # blocks of 32 weights: an f16 scale and 16 bytes of codes
    layer = LAYER_WEIGHTS * 18 // 32 + 2 * HIDDEN * 4
    assert plan["stored"]["types"] == [
        {"name": "Q4_0", "nbytes": q4_0, "weights": LAYERS * LAYER_WEIGHTS},
        {"name": "Q8_0", "nbytes": VOCAB * HIDDEN * 34 // 32, "weights": VOCAB * HIDDEN},  # the embedding
        {"name": "F32", "nbytes": NORMS * 4, "weights": NORMS},
    ]
    assert (plan["stored"]["largest_layer_bytes"], plan["stored"]["largest_layer_name"]) == (layer, "decoder layer")
    assert plan["model"]["quant"] == {  # run in place: the file's own blocks, its q and k rows as llama.cpp wrote them
        "bits": 4, "group_size": 32, "layout": "gguf", "unquantized": [], "interleaved_qk": True, "stored_bits": 4.5,
        "embed_bits": 8.5, "head_bits": 0.0,  # the token table held in its Q8_0 blocks; the head is the table
    }  # fmt: skip
    assert plan["stored"]["imported_bytes"] == 0
    assert main(argv) == 0
    sizes = capsys.readouterr().out.splitlines()[2]
    assert sizes.startswith(
        "          as stored in tiny.gguf: 518 kB at 4.85 bits a weight (Q4_0 442 kB at 4.5, Q8_0 71 kB at 8.5, "
        "F32 5 kB at 32; largest layer 223 kB, decoder layer), "
    )
    assert sizes.endswith("read in place, nothing imported")
    assert not empty_cache.exists()
    assert [p.name for p in path.parent.iterdir()] == ["tiny.gguf"]


@pytest.mark.parametrize(("qtype", "bits"), [(T.Q4_0, 4.5), (T.Q4_1, 5.0), (T.Q8_0, 8.5), (T.Q4_K, 4.5)])
def test_stored_weights_are_the_tensor_tables_bytes(tmp_path: Path, qtype: T, bits: float):
    path = tmp_path / "m.gguf"
    write_gguf(path, qtype=qtype)
    _, stored = gguf_shape(path)
    (kind,) = (t for t in stored.types if t.name == qtype.name)
    assert kind.bits == bits
    assert stored.nbytes == sum(t.nbytes for t in stored.types) < path.stat().st_size


def test_the_plan_prices_the_model_run_in_place(q4_0_gguf: Path, empty_cache: Path):
    spec, stored = gguf_shape(q4_0_gguf)
    in_place, _ = load_spec(resolve_model(q4_0_gguf))
    assert spec == dataclasses.replace(in_place, name=spec.name) and stored.imported_bytes == 0


def test_the_plan_prices_the_model_the_import_runs(tmp_path: Path, q4_k_gguf: Path):
    spec, stored = gguf_shape(q4_k_gguf)
    out = tmp_path / "imported"
    import_gguf(q4_k_gguf, out, "cpu")
    imported, _ = load_spec(out)
    assert spec == dataclasses.replace(imported, name=spec.name)
    with (out / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    tensors = [e["data_offsets"] for n, e in header.items() if not n.startswith(("__pad__", "__metadata__"))]
    assert stored.imported_bytes == sum(end - start for start, end in tensors)


def test_progress_is_one_line_rewritten_at_most_every_quarter_second():
    now = [0.0]
    out = Terminal()
    progress = Progress("importing", 400_000_000, out, clock=lambda: now[0])
    for t in (1.0, 1.1, 1.25, 4.0):
        now[0] = t
        progress.advance(100_000_000)
    assert out.getvalue().split("\r")[1:] == [
        "importing  100 MB/400 MB  25%  3s left",  # the first update: a quarter in 1 s
        "importing  300 MB/400 MB  75%  0s left",  # 1.1 s was too soon after it
        "importing  400 MB/400 MB  100%  0s left",
    ]
    progress.say("checking")
    progress.close()
    widest = len("importing  400 MB/400 MB  100%  0s left")  # a shorter line is padded over it, then cleared
    assert out.getvalue().endswith("\r" + "importing  checking".ljust(widest) + "\r" + " " * widest + "\r")


def test_progress_tells_the_time_left_at_the_rate_so_far():
    now = [0.0]
    out = Terminal()
    progress = Progress("importing", 26_400_000_000, out, clock=lambda: now[0])
    now[0] = 60.0
    progress.advance(2_640_000_000)
    assert out.getvalue() == "\rimporting  2.6 GB/26.4 GB  10%  9m00s left"


def test_progress_writes_nothing_off_a_terminal():
    out = io.StringIO()
    progress = Progress("importing", 100, out)
    progress.advance(50)
    progress.say("checking")
    progress.close()
    assert out.getvalue() == ""


@pytest.mark.parametrize("command", ["generate", "convert"])
def test_an_import_says_what_it_does_and_shows_progress_on_a_terminal(
    q4_k_gguf: Path, tmp_path: Path, empty_cache: Path, monkeypatch: pytest.MonkeyPatch, command: str
):
    if command == "generate":
        argv = ["generate", "--model", str(q4_k_gguf), "--prompt", "ab", "--max-new-tokens", "1", "--dtype", "float32"]
    else:
        argv = ["convert", "--model", str(q4_k_gguf), "--out", str(tmp_path / "out")]
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(argv) == 0
    err = terminal.getvalue()
    assert "\rimporting  " in err and " written; checking checksums" in err
    assert err.index("\rimporting") < err.index("imported   ")
    before = f"importing  {q4_k_gguf} (1 MB) into {empty_cache / 'gguf'} once; later runs reuse it\n"
    assert (before in err) == (command == "generate")
    assert (f"{q4_k_gguf} cannot run in place (tensor 'blk.0.attn_q.weight' is Q4_K" in err) == (command == "generate")


def test_an_import_off_a_terminal_says_what_it_does_and_shows_no_progress(capsys, q4_k_gguf: Path, empty_cache: Path):
    argv = ["generate", "--model", str(q4_k_gguf), "--prompt", "ab", "--max-new-tokens", "1", "--dtype", "float32"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"importing  {q4_k_gguf} (1 MB) into {empty_cache / 'gguf'} once; later runs reuse it\n" in err
    assert "imported   " in err and "\r" not in err
    assert main(argv) == 0
    assert "import" not in capsys.readouterr().err  # reused: nothing said


def _stalled_import(gguf: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    """A subprocess importing `gguf` to `out`, stopped in its staged folder; and that folder."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLED_IMPORT, str(gguf), str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "writing\n"
        (work,) = out.parent.glob(f".{out.name}{STAGING_MARK}*")
        assert work.name.startswith(f".{out.name}{STAGING_MARK}{proc.pid}-")
    except BaseException:
        proc.kill()
        raise
    return proc, work


def test_sigterm_during_an_import_leaves_nothing(q4_0_gguf: Path, tmp_path: Path):
    out = tmp_path / "models" / "tiny"
    proc, work = _stalled_import(q4_0_gguf, out)
    assert (work / "model.safetensors").is_file()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # the signal delivered again once the folder was removed
    assert list(out.parent.iterdir()) == []


def test_what_a_killed_import_left_is_swept_by_the_next_and_a_live_ones_is_not(q4_0_gguf: Path, tmp_path: Path):
    parent = tmp_path / "models"
    proc, dead = _stalled_import(q4_0_gguf, parent / "first")
    proc.kill()
    proc.wait(timeout=60)
    assert dead.is_dir()  # SIGKILL: nothing ran
    live = parent / f".sibling{STAGING_MARK}{os.getpid()}-abcdefgh"
    other = parent / ".notes.partial-x"  # not a name `staged` gives
    live.mkdir(), other.mkdir()
    import_gguf(q4_0_gguf, parent / "second", "cpu")
    assert sorted(p.name for p in parent.iterdir()) == [other.name, live.name, "second"]


def test_resolve_model_sweeps_the_cache_of_a_dead_imports_folder(q4_0_gguf: Path, empty_cache: Path):
    model = resolve_model(q4_0_gguf)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    dead = model.parent / f".{model.name}{STAGING_MARK}{gone.pid}-0a1b2c3d"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 4096)
    assert resolve_model(q4_0_gguf) == model
    assert sorted(p.name for p in model.parent.iterdir()) == [model.name]


def test_sweep_keeps_live_and_foreign_folders(tmp_path: Path):
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    names = [f".m{STAGING_MARK}{pid}-abcd1234" for pid in (dead.pid, os.getpid(), 0)]
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / f"m{STAGING_MARK}{dead.pid}-abcd1234").mkdir()  # no leading dot: not `staged`'s
    assert sweep_staged(tmp_path) == [tmp_path / names[0]]
    assert sweep_staged(tmp_path / "absent") == []


def test_sigterm_in_a_staged_block_cleans_up_and_reaches_the_previous_handler(tmp_path: Path):
    seen = []

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        interrupted = pytest.raises(OffloadError, match="interrupted by SIGTERM; nothing was written")
        with interrupted, staged(tmp_path / "out") as work:
            (work / "part").write_bytes(b"x")
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("SIGTERM did not stop the block")
        assert seen == [signal.SIGTERM]  # delivered again, once, to the handler it found
        assert signal.getsignal(signal.SIGTERM) is handler
        assert list(tmp_path.iterdir()) == []
    finally:
        signal.signal(signal.SIGTERM, previous)
