"""Security and engine bad-input cases, tried as a hostile or careless local user would.

Real engine servers on loopback, real files in /dev/shm, real `hpcrl engine serve` processes and the
launcher's real command lines read from /proc.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.embedded.http_server import HEADER_TIMEOUT_S
from hpcrl.engine.embedded.launch import embedded_launch
from hpcrl.engine.launch import LaunchSlot
from hpcrl.engine.local import LocalEngines
from hpcrl.engine.sglang import sglang_command, write_sglang_config
from hpcrl.model.hf import load_model
from hpcrl.weightwire import handover
from hpcrl.weightwire.group import broadcast, destroy_weight_group
from hpcrl.weightwire.handover import UntrustedHandoverError, create_handover, private_dir
from tests.conftest import EngineProcess, free_port, start_engine
from tests.support import assert_unfinished_heads_are_dropped, host_weight_group, skip_or_fail

PROMPT = [1, 20, 21, 14, 22, 32]
TARGET = "model.norm.weight"  # float32 [64]: 256 bytes, what an attacker maps a file into
GOOD = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "sampling_seed": 3}}


def post(url: str, path: str, body: Any, *, headers: dict | None = None, timeout_s: float = 60.0) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=timeout_s)


def weights_of(url: str, name: str = TARGET, headers: dict | None = None) -> list[float]:
    r = post(url, "/get_weights_by_name", {"name": name, "truncate_size": 1000}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def still_serves(url: str, headers: dict | None = None) -> None:
    r = post(url, "/generate", GOOD, headers=headers)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A keyless loopback engine, which any local user can reach: the worst case for a handover."""
    eng = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine"), "--group-timeout-s", "3")
    yield eng
    eng.stop()


def _forged(path: str, *, nbytes: int = 256, sign: bool = True) -> str:
    payload = {
        "kind": "shm",
        "path": path,
        "nbytes": nbytes,
        "tensors": [{"name": TARGET, "dtype": "float32", "shape": [64], "offset": 0}],
    }
    if sign:  # the attacker who somehow holds the owner's key: the file rules must still hold
        return handover._sealed(payload)
    import base64

    return base64.b64encode(json.dumps({**payload, "mac": "0" * 64}).encode()).decode()


def _token_name() -> str:
    return os.path.join(private_dir(), f"hpcrl-weights-{secrets.token_hex(16)}.bin")


def _refused(eng: EngineProcess, serialized: str, rule: str) -> None:
    before = weights_of(eng.url)
    r = post(eng.url, "/update_weights_from_tensor", {"serialized_named_tensors": [serialized]})
    assert r.status_code == 403, r.text
    assert rule in r.json()["message"], r.json()["message"]
    assert weights_of(eng.url) == before  # nothing of the file reached the model
    still_serves(eng.url)


def test_a_file_outside_the_private_dir_is_never_mapped(engine: EngineProcess) -> None:
    _refused(engine, _forged("/etc/passwd"), "not in this user's private handover directory")
    # Also a name inside the directory that create_handover would not make (e.g. the key file itself).
    _refused(engine, _forged(os.path.join(private_dir(), "handover.key")), "under a name")
    _refused(engine, _forged(private_dir() + "/../hpcrl-weights-" + "0" * 32 + ".bin"), "private handover directory")


def test_a_symlink_in_the_private_dir_to_a_foreign_file_is_refused(engine: EngineProcess) -> None:
    link = _token_name()
    os.symlink("/etc/passwd", link)
    try:
        _refused(engine, _forged(link), "symlink")
    finally:
        os.unlink(link)


def test_a_file_of_another_mode_or_size_is_refused(engine: EngineProcess) -> None:
    path = _token_name()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"secret!!" * 32)  # 256 bytes
    os.close(fd)
    try:
        os.chmod(path, 0o644)
        _refused(engine, _forged(path), "must be 0600")
        os.chmod(path, 0o600)
        _refused(engine, _forged(path, nbytes=512), "holds 256 bytes, the payload announces 512")
    finally:
        os.unlink(path)


def test_a_file_of_another_user_is_refused(engine: EngineProcess) -> None:
    if os.getuid() != 0:
        skip_or_fail("making a file of another uid needs root", missing="not root")
    path = _token_name()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"x" * 256)
    os.close(fd)
    os.chown(path, 65534, 65534)
    try:
        _refused(engine, _forged(path), "belongs to uid 65534")
    finally:
        os.unlink(path)


def test_a_payload_whose_mac_does_not_match_is_refused(engine: EngineProcess, tiny_model_dir: Path) -> None:
    tensor = load_model(tiny_model_dir).state_dict()[TARGET] + 1.0
    with create_handover([(TARGET, tensor)]) as serialized:
        payload = handover.decode_payload(serialized)
        # A real, well-formed handover file whose payload someone altered (its bytes read as another dtype).
        payload["tensors"][0]["dtype"] = "float16"
        import base64

        altered = base64.b64encode(json.dumps(payload).encode()).decode()
        _refused(engine, altered, "mac does not match")
        # A file-name guess with a made-up mac: refused before the file is even opened.
        _refused(engine, _forged(payload["path"], sign=False), "mac does not match")
        # The same handover, untouched, loads.
        r = post(engine.url, "/update_weights_from_tensor", {"serialized_named_tensors": [serialized]})
        assert r.status_code == 200 and r.json()["success"], r.text
    assert weights_of(engine.url) == pytest.approx(tensor.tolist())


def test_the_private_dir_itself_must_be_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(handover, "_handover_root", lambda: str(tmp_path))
    folder = private_dir()
    assert folder == str(tmp_path / f"hpcrl-{os.getuid()}")
    assert os.stat(folder).st_mode & 0o777 == 0o700
    os.chmod(folder, 0o755)
    with pytest.raises(UntrustedHandoverError, match="must be 0700"):
        private_dir()
    with pytest.raises(UntrustedHandoverError, match="must be 0700"):
        with create_handover([("w", torch.zeros(4))]):
            pass
    os.rmdir(folder)
    os.symlink(tmp_path, folder)  # someone put a link where the directory goes
    with pytest.raises(UntrustedHandoverError, match="not a directory"):
        private_dir()
    os.unlink(folder)
    if os.getuid() == 0:
        os.mkdir(folder, 0o700)
        os.chown(folder, 65534, 65534)
        with pytest.raises(UntrustedHandoverError, match="belongs to uid 65534"):
            private_dir()


def test_handover_files_and_key_are_private_and_gone_after() -> None:
    with create_handover([(TARGET, torch.ones(64))]) as serialized:
        path = handover.decode_payload(serialized)["path"]
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.stat(os.path.join(private_dir(), "handover.key")).st_mode & 0o777 == 0o600
    assert not os.path.exists(path)


def test_bad_handover_payloads_get_400_naming_the_field(engine: EngineProcess) -> None:
    import base64

    def enc(obj: Any) -> str:
        return base64.b64encode(json.dumps(obj).encode()).decode()

    cases = [
        ({"kind": "shm", "path": _token_name(), "nbytes": 256}, "'tensors'"),
        ({"kind": "shm", "path": _token_name(), "nbytes": 256, "tensors": {}}, "'tensors'"),
        ({"kind": "shm", "path": _token_name(), "tensors": []}, "'nbytes'"),
        ({"kind": "shm", "nbytes": 256, "tensors": []}, "'path'"),
        (
            {"kind": "shm", "path": _token_name(), "nbytes": 256, "tensors": [{"name": TARGET, "dtype": "float32"}]},
            "tensors[0]",
        ),
        (
            {
                "kind": "shm",
                "path": _token_name(),
                "nbytes": 256,
                "tensors": [{"name": TARGET, "dtype": "float32", "shape": [64], "offset": 256}],
            },
            "past the buffer's 256 bytes",
        ),
        ({"kind": "shm", "path": _token_name(), "nbytes": 256, "tensors": []}, "'mac'"),
    ]
    for payload, field in cases:
        r = post(engine.url, "/update_weights_from_tensor", {"serialized_named_tensors": [enc(payload)]})
        assert r.status_code == 400, (payload, r.text)
        assert field in r.json()["message"], (payload, r.json()["message"])
    still_serves(engine.url)


def test_non_utf8_body_gets_400_and_the_engine_serves_on(engine: EngineProcess) -> None:
    for path in ("/generate", "/update_weights_from_tensor", "/pause_generation"):
        r = httpx.post(engine.url + path, content=b'{"input_ids": "\xff\xfe"}', timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert "not UTF-8" in r.json()["error"]["message"]
    still_serves(engine.url)


def test_a_connection_that_never_finishes_its_request_head_is_dropped(engine: EngineProcess) -> None:
    """A client that connects and sends nothing, and one that sends its request head a byte every 0.2 s, each hold a
    socket only until the header timeout; /health answers other clients all along."""
    assert_unfinished_heads_are_dropped(engine.url, HEADER_TIMEOUT_S)
    still_serves(engine.url)


def test_non_finite_weights_by_handover_are_refused(engine: EngineProcess, tiny_model_dir: Path) -> None:
    before = weights_of(engine.url)
    state = load_model(tiny_model_dir).state_dict()
    bad = state[TARGET].clone()
    bad[3] = float("nan")
    named = [("model.embed_tokens.weight", state["model.embed_tokens.weight"] * 2), (TARGET, bad)]
    with create_handover(named) as serialized:
        r = post(engine.url, "/update_weights_from_tensor", {"serialized_named_tensors": [serialized]})
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert f"weight '{TARGET}' holds non-finite values" in message and "nothing of this update was loaded" in message
    assert weights_of(engine.url) == before
    assert weights_of(engine.url, "model.embed_tokens.weight")[:10] == pytest.approx(
        state["model.embed_tokens.weight"].flatten()[:10].tolist()
    )
    still_serves(engine.url)


def test_rendezvous_with_a_dead_master_is_bounded_by_the_group_timeout(engine: EngineProcess) -> None:
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    r = post(engine.url, "/init_weights_update_group", {**body, "group_name": "g", "backend": "gloo"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "could not form" in r.json()["message"] and "within 3 s" in r.json()["message"]
    still_serves(engine.url)


def _in_place_push(url: str, named: list[tuple[str, torch.Tensor]]) -> httpx.Response:
    pg, name = host_weight_group(url)
    box: dict[str, httpx.Response] = {}
    assert post(url, "/pause_generation", {"mode": "abort"}).status_code == 200  # paused: received in place
    body = {
        "names": [n for n, _ in named],
        "dtypes": ["float32"] * len(named),
        "shapes": [list(t.shape) for _, t in named],
        "group_name": name,
    }
    send = threading.Thread(target=lambda: box.update(u=post(url, "/update_weights_from_distributed", body)))
    send.start()
    for _, t in named:
        broadcast(pg, t.contiguous())
    send.join(30)
    assert post(url, "/continue_generation", {}).status_code == 200
    assert post(url, "/destroy_weights_update_group", {"group_name": name}).json()["success"]
    destroy_weight_group(pg)
    return box["u"]


def test_nan_received_in_place_blocks_generation_and_never_reaches_json_as_nan(
    engine_factory, tiny_model_dir: Path
) -> None:
    eng = engine_factory()
    good = load_model(tiny_model_dir).state_dict()[TARGET]
    bad = good.clone()
    bad[0] = float("nan")
    bad[1] = float("inf")
    r = _in_place_push(eng.url, [(TARGET, bad)])
    assert r.status_code == 400 and f"weight '{TARGET}' holds non-finite values" in r.json()["message"], r.text
    r = post(eng.url, "/generate", GOOD)
    assert r.status_code == 400 and "push finite weights" in r.json()["error"]["message"], r.text
    raw = post(eng.url, "/get_weights_by_name", {"name": TARGET}).text
    assert "NaN" not in raw and "Infinity" not in raw
    values = json.loads(raw, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert values[:3] == [None, None, pytest.approx(good[2].item())]
    # Finite weights heal it.
    assert _in_place_push(eng.url, [(TARGET, good)]).json()["success"]
    still_serves(eng.url)


def test_sigterm_ends_an_engine_blocked_in_a_rendezvous(engine_factory) -> None:
    eng = engine_factory()  # the default --group-timeout-s 300: the wait the issue saw
    with socket.socket() as master:  # accepts, never answers: a trainer that died after listen()
        master.bind(("127.0.0.1", 0))
        master.listen()
        master.settimeout(60)  # an engine that never dials fails the test instead of hanging it
        body = {"master_address": "127.0.0.1", "master_port": master.getsockname()[1], "rank_offset": 1}
        box: dict[str, object] = {}

        def init() -> None:
            try:
                box["r"] = post(eng.url, "/init_weights_update_group", {**body, "world_size": 2, "backend": "gloo"})
            except httpx.HTTPError as exc:
                box["r"] = exc

        caller = threading.Thread(target=init)
        caller.start()
        conn, _ = master.accept()  # the engine's rendezvous is now under way
        eng.proc.send_signal(signal.SIGTERM)
        try:
            code = eng.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("a SIGTERM'd engine still waits on its rendezvous")
        conn.close()
        caller.join(30)
    assert code == 0
    assert "signal 15: shutting down" in eng.log()
    assert not isinstance(box.get("r"), httpx.Response) or box["r"].status_code != 200  # type: ignore[union-attr]


# ----- starting `hpcrl engine serve` -----


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hpcrl.cli", "engine", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--host", "0.0.0.0"], "--host 0.0.0.0 is reachable from other machines"),
        (["--host", "10.1.2.3", "--api-key", ""], "the API key is empty"),
        (["--max-running-requests", "0"], "max_running_requests must be >= 1, got 0 (from --max-running-requests 0)"),
        (["--port", "99999"], "--port 99999 is not a TCP port"),
        (["--port", "0"], "--port 0 is not a TCP port"),
        (["--group-timeout-s", "nan"], "engine.group_timeout_s: expected a finite number, got nan"),
        (["--api-key", "a", "--api-key-file", "/dev/null"], "--api-key or --api-key-file, not both"),
    ],
)
def test_bad_serve_flags_are_refused_before_the_model_loads(args: list[str], message: str, tmp_path: Path) -> None:
    # No model at --model: a refusal that names the flag was decided before any load.
    r = serve("--model", str(tmp_path / "no-model"), *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("hpcrl: error: ") and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    if args[:2] == ["--host", "0.0.0.0"]:
        assert "--api-key-file" in r.stderr and "HPCRL_ENGINE_API_KEY" in r.stderr


def test_context_length_above_the_models_positions_is_refused(tiny_model_dir: Path) -> None:
    r = serve("--model", str(tiny_model_dir), "--context-length", "5000")
    assert r.returncode == 2, r.stderr
    assert "context_length 5000 is above the model's max_position_embeddings 1024" in r.stderr, r.stderr


def _start_with_key(model: Path, log_dir: Path, key: str, *args: str, env: dict[str, str] | None = None) -> Any:
    port = free_port()
    log = open(log_dir / f"engine-{port}.log", "wb")  # noqa: SIM115 - closed with the process below
    cmd = [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model), "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"engine did not start: {(log_dir / f'engine-{port}.log').read_text()}")


def test_api_key_file_and_environment_guard_the_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "engine.key"
    key_file.write_text("k3y-from-file\n")
    key_file.chmod(0o644)
    r = serve("--model", str(tiny_model_dir), "--api-key-file", str(key_file))
    assert r.returncode == 2 and "others can read the key; run `chmod 600" in r.stderr, r.stderr
    key_file.chmod(0o600)
    proc, url, log = _start_with_key(
        tiny_model_dir, tmp_path, "k3y-from-file", "--api-key-file", str(key_file),
        env={"HPCRL_ENGINE_API_KEY": "ignored-when-a-file-is-given"},
    )  # fmt: skip
    try:
        assert post(url, "/generate", GOOD).status_code == 401
        assert (
            post(url, "/generate", GOOD, headers={"Authorization": "Bearer ignored-when-a-file-is-given"}).status_code
            == 401
        )
        still_serves(url, headers={"Authorization": "Bearer k3y-from-file"})
        assert "k3y-from-file" not in Path(f"/proc/{proc.pid}/cmdline").read_text()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_launcher_puts_the_key_in_no_command_line_and_no_environment(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc/<pid>/environ keeps a process's start-up environment for its life, whatever the process unsets: the
    run's key reaches the engine in a 0600 file, and a key in the launcher's own environment is not passed on."""
    monkeypatch.setenv("HPCRL_ENGINE_API_KEY", "launchers-own-key")
    cfg = EngineConfig(num_engines=1, startup_timeout_s=90)
    engines = LocalEngines(cfg, tiny_model_dir, tmp_path / "run", seed=0)
    clients = engines.start()
    try:
        eng = engines.engines[0]
        cmdline = Path(f"/proc/{eng.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"hpcrl.cli" in cmdline and b"serve" in cmdline
        assert eng.token.encode() not in b" ".join(cmdline) and b"--api-key" not in cmdline
        environ = Path(f"/proc/{eng.proc.pid}/environ").read_bytes()
        assert eng.token.encode() not in environ
        assert b"HPCRL_ENGINE_API_KEY" not in environ and b"launchers-own-key" not in environ
        key_file = Path(cmdline[cmdline.index(b"--api-key-file") + 1].decode())
        assert key_file == tmp_path / "run" / "engines" / "engine-0.key"
        assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.read_text() == eng.token + "\n"
        # The key still guards the engine: the launcher's client has it, a bare request does not.
        assert clients[0].health()
        assert httpx.get(eng.url + "/model_info", timeout=10).status_code == 401
        assert post(eng.url, "/generate", GOOD).status_code == 401
        assert (
            post(eng.url, "/generate", GOOD, headers={"Authorization": "Bearer launchers-own-key"}).status_code == 401
        )
        still_serves(eng.url, headers={"Authorization": f"Bearer {eng.token}"})
    finally:
        engines.stop()
        for c in clients:
            c.close()


def test_launch_files_are_written_through_no_planted_link(tmp_path: Path) -> None:
    """A link planted at a launch file's name, or at its temporary name, is replaced, never written through."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    engines = tmp_path / "run" / "engines"
    engines.mkdir(parents=True)
    (engines / "engine-0.key").symlink_to(victim)
    (engines / "engine-0.yaml.tmp").symlink_to(victim)
    (engines / "engine-1.sglang.yaml.tmp").symlink_to(victim)
    slot = LaunchSlot(
        index=0, position=0, model_dir="/m", host="127.0.0.1", port=30000, api_key="k3y", seed=0,
        run_dir=tmp_path / "run",
    )  # fmt: skip
    cmd = embedded_launch(EngineConfig(), slot).cmd
    write_sglang_config(engines / "engine-1.sglang.yaml", api_key="k3y")
    assert victim.read_text() == "precious\n"
    for name in ("engine-0.key", "engine-0.yaml", "engine-1.sglang.yaml"):
        path = engines / name
        assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600, name
    assert (engines / "engine-0.key").read_text() == "k3y\n"
    assert str(engines / "engine-0.key") in cmd and "k3y" not in " ".join(cmd)
    assert sorted(p.name for p in engines.iterdir()) == ["engine-0.key", "engine-0.yaml", "engine-1.sglang.yaml"]


def test_sglang_gets_its_key_from_a_private_config_file_not_its_command_line(tmp_path: Path) -> None:
    import yaml

    token = "0123456789"  # digits: YAML would load it as a number unless quoted
    config = write_sglang_config(tmp_path / "engine-0.sglang.yaml", api_key=token)
    assert config.stat().st_mode & 0o777 == 0o600
    assert yaml.safe_load(config.read_text()) == {"api-key": token}
    cmd = sglang_command(
        EngineConfig(kind="sglang"), python="python3", model_dir="/m", host="10.0.0.5", port=30001,
        config_file=config, seed=0, weight_version="0",
    )  # fmt: skip
    assert token not in " ".join(cmd) and "--api-key" not in cmd
    assert cmd[cmd.index("--config") + 1] == str(config)
    with pytest.raises(ValueError, match="only from a .yaml or .yml file"):
        write_sglang_config(tmp_path / "engine-0.txt", api_key=token)
