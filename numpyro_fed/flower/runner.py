"""Running a deployment: in one process over Flower messages (tests, notebooks), as real
processes on loopback (SuperLink + SuperNodes + ``flwr run``), and its InferenceData.

:class:`LoopbackGrid` is a Flower ``Grid`` that delivers every message to a real
``ClientApp`` in this process, round-tripping each content through Flower's protobuf
serialisation (so only what Flower can put on the wire reaches the other side, and its size
is measured), with per-node ``Context`` persistence and fault injection (a client that does
not answer, answers too late, crashes, or sends a corrupted or oversized message).

:func:`run_processes` runs the same deployment as real processes on ``127.0.0.1``: a
``flower-superlink``, one ``flower-supernode`` per client (each reading only its own
``.npz``), an app directory written by :func:`write_app`, and ``flwr run``; optionally over
TLS with a throwaway CA (:func:`make_tls_files`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.serverapp import Grid

from numpyro_fed.flower.apps import error_path, make_client_app, serve
from numpyro_fed.flower.checks import ClientMismatchError, DeploymentError, ParticipationError
from numpyro_fed.flower.protocol import FlowerSpec, ServerCoordinator
from numpyro_fed.flower.results import to_inference_data
from numpyro_fed.kernels.base import DivergenceError

__all__ = [
    "LoopbackGrid",
    "run_loopback",
    "to_inference_data",
    "FAULTS",
    "write_app",
    "make_tls_files",
    "make_node_keys",
    "run_processes",
    "flower_executables",
]

#: Faults understood by :class:`LoopbackGrid` (``faults(node_id, group_id) -> name | None``).
FAULTS = ("drop", "timeout", "crash", "corrupt", "oversize")


def _wire(content: RecordDict) -> RecordDict:
    return recorddict_from_proto(recorddict_to_proto(content))


class LoopbackGrid(Grid):
    """A Flower ``Grid`` whose nodes are ``ClientApp`` calls in this process.

    :param client_app: the ``ClientApp`` every node runs.
    :param node_configs: one ``node_config`` per node (e.g. ``{"partition-id": i}``).
    :param faults: optional ``(node_id, group_id) -> fault`` with a fault of :data:`FAULTS`:
        ``"drop"`` (the node never gets the message), ``"timeout"`` (it runs but its reply
        never arrives), ``"crash"`` (the ClientApp raises), ``"corrupt"`` (payload bytes
        garbled), ``"oversize"`` (payload padded far beyond any valid message).
    :param first_node_id: node ids are ``first_node_id + 7 * k`` (not the client indices, as
        with a SuperLink).
    """

    def __init__(self, client_app: Any, node_configs: Sequence[Mapping[str, Any]],
                 faults: Callable[[int, str], str | None] | None = None,
                 first_node_id: int = 1001) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        # what a SuperLink sets in a ServerApp process (run 1, the server's node 0, task 0)
        for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
            if getattr(TaskIdentity, attr) is None:
                setattr(TaskIdentity, attr, value)
        self.client_app = client_app
        self.faults = faults
        ids = [first_node_id + 7 * k for k in range(len(node_configs))][::-1]
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config=dict(cfg), state=RecordDict(),
                         run_config={})
            for nid, cfg in zip(ids, node_configs, strict=True)
        }
        self._replies: dict[str, Message] = {}
        self._run = None

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            node = msg.metadata.dst_node_id
            fault = self.faults(node, msg.metadata.group_id) if self.faults else None
            if fault not in (None, *FAULTS):
                raise ValueError(f"unknown fault {fault!r}; use one of {FAULTS}")
            if fault == "drop" or node not in self.contexts:
                continue
            delivered = Message(_wire(msg.content), dst_node_id=node,
                                message_type=msg.metadata.message_type,
                                group_id=msg.metadata.group_id)
            delivered.metadata.__dict__["_message_id"] = mid
            delivered.metadata.__dict__["_src_node_id"] = 0
            if fault == "crash":
                from flwr.app import Error

                reply = Message(Error(code=0, reason="ClientApp raised RuntimeError"),
                                reply_to=delivered)
            else:
                reply = self.client_app(delivered, self.contexts[node])
            if fault == "timeout":
                continue
            if not reply.has_error():
                content = _wire(reply.content)
                if fault in ("corrupt", "oversize"):
                    payload = content["reply"]["payload"].numpy().copy()
                    if fault == "corrupt":
                        payload = np.concatenate([payload[::-1] ^ 0x5A, [0xFF]]).astype(np.uint8)
                    else:
                        payload = np.concatenate([payload, np.ones(1 << 16, np.uint8)])
                    content["reply"] = ArrayRecord({"payload": Array(payload)})
                reply = Message(content, reply_to=delivered)
            self._replies[mid] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(m) for m in message_ids if m in self._replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(list(messages)))


def raise_server_error(output: str | os.PathLike, logs: str | os.PathLike = "") -> None:
    """Raise, in the launching process, the :class:`~numpyro_fed.DivergenceError` or
    :class:`~numpyro_fed.flower.checks.DeploymentError` that the ``ServerApp`` of a deployment
    writing to ``output`` stopped with (see :func:`~numpyro_fed.flower.apps.serve_and_write`);
    nothing if it did not."""
    err_file = Path(error_path(output))
    if not err_file.exists():
        return
    info = json.loads(err_file.read_text())
    if info.get("type") == "ParticipationError":
        raise ParticipationError(f"{info['message']} (Flower run; logs in {logs})",
                                 info.get("rounds") or ())
    if info.get("type") == "ClientMismatchError":
        raise ClientMismatchError(f"{info['message']} (Flower run; logs in {logs})",
                                  info.get("clients") or ())
    if info.get("type") == "DeploymentError":
        raise DeploymentError(f"{info['message']} (Flower run; logs in {logs})")
    err = DivergenceError(f"{info['message']} (Flower run; logs in {logs})")
    err.iteration, err.chain = info.get("iteration"), info.get("chain")
    raise err


def run_loopback(spec: FlowerSpec, clients: Sequence[Mapping[str, Any]], *,
                 faults: Callable[[int, str], str | None] | None = None,
                 client_app: Any = None, **kwargs: Any) -> ServerCoordinator:
    """Run a deployment in this process: one ``ClientApp`` per entry of ``clients`` (client
    ``i`` holds only ``clients[i]``), the server over a :class:`LoopbackGrid`.

    :param spec: the :class:`~numpyro_fed.flower.protocol.FlowerSpec`.
    :param clients: per-client rows (mappings of arrays with a leading row axis).
    :param faults: fault injection, see :class:`LoopbackGrid`.
    :param client_app: a custom ``ClientApp`` (default: :func:`make_client_app`).
    :param kwargs: options of :class:`~numpyro_fed.flower.protocol.ServerCoordinator`.
    """
    data = [dict(c) for c in clients]

    def load(context):
        i = int(context.node_config["partition-id"])
        return i, data[i], {}

    app = client_app or make_client_app(load)
    grid = LoopbackGrid(app, [{"partition-id": i} for i in range(len(data))], faults=faults)
    return serve(grid, spec, **kwargs)


# ====================================================================== real processes
_SERVER_APP = """\
from numpyro_fed.flower import make_server_app

app = make_server_app(poll_interval={poll})
"""
_CLIENT_APP = """\
from numpyro_fed.flower import make_client_app

app = make_client_app()  # node_config: partition-id, data-path (the client's own .npz)
"""


def write_app(app_dir: str | os.PathLike, spec: FlowerSpec, output: str | os.PathLike, *,
              poll_interval: float = 0.05, name: str = "numpyro-fed-app") -> Path:
    """Write a Flower app directory for ``flwr run``.

    ``pyproject.toml`` (``[tool.flwr.app.components]`` naming ``server_app:app`` and
    ``client_app:app``; ``[tool.flwr.app.config]`` = the keys of ``spec`` plus
    ``output``), ``server_app.py`` (:func:`~numpyro_fed.flower.apps.make_server_app` with
    ``poll_interval``) and ``client_app.py``
    (:func:`~numpyro_fed.flower.apps.make_client_app`, reading ``partition-id`` and
    ``data-path`` from the SuperNode's ``--node-config``). The code of ``numpyro_fed`` and
    of the model must be importable where the apps run (the app declares no dependency).

    :return: the app directory.
    """
    import tomli_w

    app = Path(app_dir)
    app.mkdir(parents=True, exist_ok=True)
    config = dict(spec.to_config())
    config["output"] = str(Path(output).resolve())
    pyproject = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": name, "version": "1.0.0", "license": "Apache-2.0",
                    "description": "numpyro_fed federated sampler", "dependencies": []},
        "tool": {"flwr": {"app": {
            "publisher": "numpyro-fed",
            "components": {"serverapp": "server_app:app", "clientapp": "client_app:app"},
            "config": config,
        }}},
    }
    (app / "pyproject.toml").write_text(tomli_w.dumps(pyproject))
    (app / "server_app.py").write_text(_SERVER_APP.format(poll=float(poll_interval)))
    (app / "client_app.py").write_text(_CLIENT_APP)
    return app


def make_tls_files(directory: str | os.PathLike,
                   hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> dict[str, Path]:
    """A throwaway CA and a server certificate for ``hosts`` (PEM; EC P-256, 1 day).

    For tests and local trials only: in a real deployment use your organisation's PKI.

    :return: ``{"ca": ca.crt, "cert": server.pem, "key": server.key}`` paths.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "numpyro_fed test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": out / "ca.crt", "cert": out / "server.pem", "key": out / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return paths


def make_node_keys(directory: str | os.PathLike, num_nodes: int) -> list[tuple[Path, Path]]:
    """EC P-384 key pairs for SuperNode authentication, in OpenSSH format (what
    ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` read;
    the same as ``ssh-keygen -t ecdsa -b 384 -N '' -f client_i``).

    :return: ``[(private key, public key)]`` paths, one pair per node.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for i in range(num_nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        priv, pub = out / f"client_{i}", out / f"client_{i}.pub"
        priv.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
        priv.chmod(0o600)
        pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                      serialization.PublicFormat.OpenSSH))
        pairs.append((priv, pub))
    return pairs


_EXECUTABLES = ("flower-superlink", "flower-supernode", "flwr", "flwr-clientapp",
                "flwr-serverapp", "flower-superexec")


def flower_executables() -> dict[str, str] | None:
    """Paths of Flower's executables (next to this Python first, then on ``PATH``); ``None``
    if one is missing."""
    found = {}
    here = os.path.dirname(sys.executable)
    for name in _EXECUTABLES:
        path = shutil.which(name, path=here) or shutil.which(name)
        if path is None:
            return None
        found[name] = path
    return found


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive (zombies excluded; Linux ``/proc``)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{_tail(log)}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s:\n"
                       f"{_tail(log)}")


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class _Processes:
    """The processes of a loopback deployment, each in its own process group (so that the
    ``flower-superexec``, ``flwr-serverapp`` and ``flwr-clientapp`` processes they spawn are
    ended with them)."""

    def __init__(self, env: Mapping[str, str], logs: Path) -> None:
        self.env = dict(env)
        self.logs = logs
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        self.groups: list[int] = []

    def start(self, name: str, args: Sequence[str],
              env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(list(args), stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**self.env, **(env or {})},
                                    cwd=str(self.logs), start_new_session=True)
        self.procs.append((proc, log))
        self.groups.append(proc.pid)
        return proc, log

    def stop(self, grace: float = 5.0) -> list[int]:
        """SIGTERM every group, SIGKILL what is left after ``grace`` s; return the groups
        that still have live processes (empty when all ended)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pgid in self.groups:
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + grace
            while time.monotonic() < end and any(map(_group_alive, self.groups)):
                for proc, _ in self.procs:
                    proc.poll()
                time.sleep(0.1)
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        return [g for g in self.groups if _group_alive(g)]


_SHIM = """\
#!{python} -IS
# flwr-clientapp, forwarded to numpyro_fed's warm launcher (a forked, pre-imported process)
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect({sock!r})
s.sendall(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd()}}).encode() + b"\\n")
sys.exit(int(s.makefile("rb").readline() or b"1"))
"""


def _warm_launcher(sock_path: str, preload: Sequence[str]) -> None:
    """Serve ``flwr-clientapp`` launches by forking this pre-imported process.

    Flower starts one ``flwr-clientapp`` process per message; a cold start re-imports flwr,
    JAX, NumPyro and ``numpyro_fed`` (seconds per message). Here they are imported once
    (without initialising a JAX backend, so forking is safe: one thread, no XLA client) and
    every launch is ``fork`` + Flower's own ``flwr-clientapp`` entry point with the
    arguments the SuperNode's SuperExec passed to the shim (:data:`_SHIM`), which waits for
    the child and exits with its status.
    """
    import importlib
    import json
    import select
    import threading

    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    for module in preload:
        importlib.import_module(module)
    from jax._src import xla_bridge

    if threading.active_count() != 1 or xla_bridge._backends:
        raise RuntimeError("warm launcher: a thread or a JAX backend was started while "
                           f"importing {list(preload)}; forking would be unsafe")
    server = socket.socket(socket.AF_UNIX)
    server.bind(sock_path)
    server.listen(64)
    waiting: dict[int, socket.socket] = {}
    started: dict[int, float] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        ready, _, _ = select.select([server], [], [], 0.02)
        if ready:
            conn, _ = server.accept()
            request = json.loads(conn.makefile("rb").readline())
            pid = os.fork()
            if pid == 0:  # the ClientApp process
                server.close()
                for other in waiting.values():
                    other.close()
                conn.close()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                code = 0
                try:
                    os.chdir(request["cwd"])
                    sys.argv = ["flwr-clientapp", *request["argv"]]
                    flwr_clientapp()
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:  # noqa: BLE001 - reported like a crashed process
                    import traceback

                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            waiting[pid] = conn
            started[pid] = time.monotonic()
            print(f"warm launcher: ClientApp pid {pid} started", flush=True)
        for pid in list(waiting):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn = waiting.pop(pid)
                print(f"warm launcher: ClientApp pid {pid} ended with status "
                      f"{os.waitstatus_to_exitcode(status)} after "
                      f"{time.monotonic() - started.pop(pid):.2f} s", flush=True)
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


def _start_warm(procs: _Processes, work: Path, spec: FlowerSpec) -> tuple[Path, Callable]:
    """Start the warm launcher; return the folder of its ``flwr-clientapp`` shim and a
    function that waits until the launcher listens."""
    import tempfile

    sock = work / "warm.sock"
    if len(str(sock)) > 100:  # AF_UNIX path limit (108 bytes)
        sock = Path(tempfile.mkdtemp(prefix="nfed")) / "warm.sock"
    preload = ["numpyro_fed.flower", spec.model.partition(":")[0]]
    code = ("import sys; from numpyro_fed.flower.runner import _warm_launcher; "
            "_warm_launcher(sys.argv[1], sys.argv[2:])")
    proc, log = procs.start("warm_launcher", [sys.executable, "-c", code, str(sock), *preload])
    shim_dir = work / "bin"
    shim_dir.mkdir(exist_ok=True)
    shim = shim_dir / "flwr-clientapp"
    shim.write_text(_SHIM.format(python=sys.executable, sock=str(sock)))
    shim.chmod(0o755)

    def wait(timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the warm ClientApp launcher did not start:\n{_tail(log)}")
            time.sleep(0.05)

    return shim_dir, wait


def run_processes(spec: FlowerSpec, clients: Sequence[Mapping[str, Any]],
                  workdir: str | os.PathLike, *, tls: bool = False, node_auth: bool = False,
                  timeout: float = 600.0, poll_interval: float = 0.05,
                  warm_clients: bool = True, env: Mapping[str, str] | None = None,
                  on_stopped: Callable[[list[int]], None] | None = None):
    """Run a deployment as real processes on ``127.0.0.1``; return its InferenceData.

    Starts ``flower-superlink`` (runtime dependency installation disabled: nothing is
    downloaded), one ``flower-supernode`` per client with ``--node-config
    "partition-id=i data-path='workdir/data/client_i.npz'"`` (client ``i``'s rows, written
    here: the only data that process reads), writes the app (:func:`write_app`) and submits
    it with ``flwr run``; waits for the run to end and reads the draws back. Flower's home
    (``FLWR_HOME``, ``HOME``: its ``config.toml`` with the SuperLink connection, the
    installed apps) is ``workdir/home``; telemetry is off. Every process is ended when this
    returns or raises; logs are in ``workdir/logs``.

    Flower runs one ``flwr-clientapp`` process per message, which would re-import JAX for
    every message (seconds each); with ``warm_clients`` the SuperNodes find first on their
    ``PATH`` a ``flwr-clientapp`` that forks a process in which flwr, JAX, NumPyro,
    ``numpyro_fed`` and the model's module are already imported, and runs Flower's own
    ``flwr-clientapp`` entry point there (:func:`_warm_launcher`). The SuperNode still waits
    3 s before asking again for a message when there was none (flwr 1.41): a round costs a
    few seconds whatever the kernel's cost (measured in ``tests/test_flower_processes.py``).

    :param spec: the run's :class:`~numpyro_fed.flower.protocol.FlowerSpec`.
    :param clients: per-client rows (mappings of arrays with a leading row axis).
    :param workdir: an empty or scratch directory.
    :param tls: TLS between every process and the SuperLink, with a throwaway CA
        (:func:`make_tls_files`); otherwise ``--insecure``.
    :param node_auth: SuperNode authentication (needs ``tls``): the SuperLink runs with
        ``--enable-supernode-auth``, each client's public key (:func:`make_node_keys`) is
        registered with ``flwr supernode register`` before its SuperNode starts with
        ``--auth-supernode-private-key``.
    :param timeout: seconds for the whole run.
    :param poll_interval: the ServerApp's polling interval
        (:class:`~numpyro_fed.flower.apps.PollingGrid`).
    :param warm_clients: fork ClientApp processes from a pre-imported launcher (see above)
        instead of Flower's cold ``flwr-clientapp`` start.
    :param env: extra environment variables for every process.
    :param on_stopped: called with the process groups still alive after the shutdown
        (an empty list when all ended), e.g. for a test's assertion.
    :return: ``arviz.InferenceData`` as :func:`to_inference_data`.
    """
    import arviz as az
    import tomli_w

    exe = flower_executables()
    if exe is None:
        raise RuntimeError(f"Flower's executables {_EXECUTABLES} are not installed "
                           "(pip install numpyro_fed[flower]).")
    if len(clients) != spec.num_clients:
        raise ValueError(f"`clients` has {len(clients)} entries but spec.num_clients="
                         f"{spec.num_clients}; pass one mapping of rows per client.")
    if node_auth and not tls:
        raise ValueError("`node_auth=True` needs `tls=True` (Flower authenticates SuperNodes "
                         "only over TLS).")
    work = Path(workdir).resolve()
    home, data, logs = work / "home", work / "data", work / "logs"
    for d in (home, data, logs):
        d.mkdir(parents=True, exist_ok=True)
    output = work / "draws.nc"
    for stale in (output, Path(error_path(output))):
        if stale.exists():
            stale.unlink()
    app = write_app(work / "app", spec, output, poll_interval=poll_interval)
    link_port, *node_ports = _free_ports(1 + len(clients))
    penv = {**os.environ, "HOME": str(home), "FLWR_HOME": str(home),
            "FLWR_TELEMETRY_ENABLED": "0", "JAX_PLATFORMS": "cpu",
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.05",
            "JAX_COMPILATION_CACHE_DIR": str(work / "jax_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "PATH": os.path.dirname(exe["flwr"]) + os.pathsep + os.environ.get("PATH", ""),
            **(env or {})}
    if tls:
        certs = make_tls_files(work / "certificates")
        link_sec = ["--ssl-ca-certfile", str(certs["ca"]), "--ssl-certfile",
                    str(certs["cert"]), "--ssl-keyfile", str(certs["key"])]
        node_sec = ["--root-certificates", str(certs["ca"])]
        connection = {"address": f"127.0.0.1:{link_port}", "root-certificates": str(certs["ca"])}
    else:
        link_sec, node_sec = ["--insecure"], ["--insecure"]
        connection = {"address": f"127.0.0.1:{link_port}", "insecure": True}
    (home / "config.toml").write_text(tomli_w.dumps(
        {"superlink": {"default": "loopback", "loopback": connection}}))
    procs = _Processes(penv, logs)
    try:
        auth = ["--enable-supernode-auth"] if node_auth else []
        link, link_log = procs.start("superlink", [
            exe["flower-superlink"], *link_sec, *auth, "--port", str(link_port),
            "--disable-runtime-dependency-installation"])
        node_env, warm_wait = None, None
        if warm_clients:  # starts while the SuperLink does
            shim_dir, warm_wait = _start_warm(procs, work, spec)
            node_env = {"PATH": f"{shim_dir}{os.pathsep}{penv['PATH']}"}
        _wait_port(link_port, link, link_log, 60.0)
        keys = make_node_keys(work / "keys", len(clients)) if node_auth else []
        registering = [  # in parallel: each is a cold start of the flwr CLI
            procs.start(f"register_{i}", [exe["flwr"], "supernode", "register", str(pub),
                                          "loopback"])
            for i, (_, pub) in enumerate(keys)
        ]
        for i, (reg, reg_log) in enumerate(registering):
            if reg.wait(timeout=120) != 0:
                raise RuntimeError(f"registering client {i}'s key failed:\n{_tail(reg_log)}")
        if warm_wait is not None:
            warm_wait()
        for i, (rows, port) in enumerate(zip(clients, node_ports, strict=True)):
            path = data / f"client_{i}.npz"
            np.savez(path, **{k: np.asarray(v) for k, v in rows.items()})
            auth = ["--auth-supernode-private-key", str(keys[i][0])] if node_auth else []
            procs.start(f"supernode_{i}", [
                exe["flower-supernode"], *node_sec, *auth, "--superlink", f"127.0.0.1:{link_port}",
                "--port", str(port), "--node-config", f"partition-id={i} data-path='{path}'"],
                env=node_env)
        run, run_log = procs.start("flwr_run", [exe["flwr"], "run", str(app), "loopback",
                                                "--stream"])
        try:
            run.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the Flower run did not end within {timeout:.0f} s; logs in "
                               f"{logs}:\n{_tail(run_log)}") from None
        raise_server_error(output, logs)
        if not output.exists():
            raise RuntimeError(f"the Flower run ended without writing {output}; logs in "
                               f"{logs}:\n{_tail(run_log)}")
        return az.from_netcdf(str(output))
    finally:
        alive = procs.stop()
        if on_stopped is not None:
            on_stopped(alive)

