"""Running a deployment as real processes on ``127.0.0.1``: a ``flower-superlink``, one
``flower-supernode`` per client (each reading only its own ``.npz``), an app directory written
by :func:`write_app`, and ``flwr run`` (:func:`run_processes`); optionally over TLS with a
throwaway CA and with node authentication (:mod:`numpyro_fed.flower.security`). A fork server
(:func:`_warm_launcher`) keeps JAX and the model imported for Flower's per-message
``flwr-clientapp`` processes; :func:`raise_server_error` raises the ``ServerApp``'s error in the
launching process.
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from numpyro_fed.flower.apps import error_path
from numpyro_fed.flower.checks import ClientMismatchError, DeploymentError, ParticipationError
from numpyro_fed.flower.protocol import FlowerSpec
from numpyro_fed.flower.security import make_node_keys, make_tls_files
from numpyro_fed.kernels.base import DivergenceError

__all__ = ["write_app", "run_processes", "flower_executables", "raise_server_error"]


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
    if ":" in spec.algorithm:  # an algorithm defined outside the package: its module too
        preload.append(spec.algorithm.partition(":")[0])
    code = ("import sys; from numpyro_fed.flower.processes import _warm_launcher; "
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
    # the processes import the numpyro_fed this process runs (not another installed copy)
    root = str(Path(__file__).resolve().parents[2])
    pypath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    penv = {**os.environ, "HOME": str(home), "FLWR_HOME": str(home), "PYTHONPATH": pypath,
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

