"""Real servers the tests start for themselves, on free loopback ports."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

#: Ports for the tests' servers lie below the kernel's ephemeral range (32768 and up on
#: Linux), from which every outgoing connection takes its own port: a port picked there
#: may be taken by a client connection before the server binds it, or while the server
#: is down to be restarted on it. Each pytest-xdist process has a block of its own.
PORT_BLOCKS, PORT_BLOCK_SIZE = range(20000, 32000), 1500


def _port_cursor():
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    number = int(worker[2:]) if worker[2:].isdigit() else 0
    first = PORT_BLOCKS.start + (number * PORT_BLOCK_SIZE) % len(PORT_BLOCKS)
    block = range(first, first + PORT_BLOCK_SIZE)
    # A process started by a test inherits the worker's name: it starts elsewhere.
    offset = int.from_bytes(os.urandom(2), "big") % PORT_BLOCK_SIZE
    while True:
        for index in range(PORT_BLOCK_SIZE):
            yield block[(offset + index) % PORT_BLOCK_SIZE]


_ports = _port_cursor()


def free_port() -> int:
    """A loopback port nothing listens on, not handed out before by this process."""
    for _ in range(PORT_BLOCK_SIZE):
        port = next(_ports)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # a service of the machine's, or a server still closing
            return port
    raise RuntimeError(f"no free loopback port in {PORT_BLOCKS}")


class RedisServer:
    """A ``redis-server`` child process the test owns: it can kill and restart it."""

    def __init__(self, appendonly: bool = False, extra: tuple = (), tls=None) -> None:
        #: Persist every write (fsync always), as a lease store must if a restart is
        #: to keep its fencing counters: counters that restart at 1 pass no fence.
        self.appendonly = appendonly
        #: More ``redis-server`` arguments (``--maxmemory-policy``, ``--cluster-enabled``).
        self.extra = tuple(extra)
        #: A :class:`TLSFiles`: serve TLS only (``--port 0 --tls-port``).
        self.tls = tls
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="exclusive-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://127.0.0.1:{self.port}/0"

    def url_for_db(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                "always",
                "--dir",
                self.dir,
                "--databases",
                "32",
                *self._listen_args(),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = self.client(socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
            finally:
                client.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(10)
        self.process = None

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return []
        return ["--port", "0", "--tls-port", str(self.port), *self.tls.server_args()]

    def client(self, db: int = 0, **kwargs) -> redis.Redis:
        if self.tls is not None:
            kwargs = {"ssl": True, "ssl_ca_certs": self.tls.ca, **kwargs}
        return redis.Redis(port=self.port, db=db, **kwargs)

    def cleanup(self) -> None:
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: neither gone nor a zombie. A process reaped between
    opening and reading its /proc entry is gone too."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def kill_tree(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal a child started with ``start_new_session=True`` and its whole group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _as_postgres_user() -> list[str]:
    """PostgreSQL refuses to run as root: run its programs as the ``postgres`` user then."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def postgres_bin() -> str:
    """The directory of Debian's PostgreSQL server programs (the newest installed)."""
    versions = sorted(
        (p for p in glob.glob("/usr/lib/postgresql/*/bin") if os.path.exists(p + "/postgres")),
        key=lambda p: int(p.split("/")[-2]),
    )
    if not versions:
        raise RuntimeError("PostgreSQL is not installed: apt-get install postgresql")
    return versions[-1]


class PostgresServer:
    """A ``postgres`` cluster of the test's own (``initdb`` in a temp dir, a free port):
    it can be stopped, killed and restarted, and keeps its data across restarts."""

    #: The superuser's password: TCP connections authenticate with scram-sha-256.
    password = "exclusive"

    def __init__(self) -> None:
        self.bin = postgres_bin()
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="exclusive-postgres-")
        os.chmod(self.dir, 0o755)
        self.data = os.path.join(self.dir, "data")
        self.process: subprocess.Popen | None = None
        self._initdb()

    def _initdb(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        password_file = os.path.join(self.dir, "password")
        Path(password_file).write_text(self.password)
        if os.geteuid() == 0:
            shutil.chown(password_file, "postgres", "postgres")
        subprocess.run(
            [*_as_postgres_user(), f"{self.bin}/initdb", "-D", self.data]
            + ["--auth-local=trust", "--auth-host=scram-sha-256", "--pwfile", password_file]
            + ["-U", "postgres", "-E", "UTF8", "--no-sync", "--no-instructions"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    @property
    def url(self) -> str:
        return self.url_for(port=self.port)

    def url_for(self, user="postgres", password=None, port=None, database="postgres") -> str:
        password = self.password if password is None else password
        return f"postgresql://{user}:{password}@127.0.0.1:{port or self.port}/{database}"

    def start(self) -> None:
        # fsync off: a killed server process still keeps every committed write (the WAL
        # is written at commit; only an OS crash would lose it), and tests run faster.
        self.process = subprocess.Popen(
            [*_as_postgres_user(), f"{self.bin}/postgres", "-D", self.data]
            + ["-p", str(self.port), "-h", "127.0.0.1", "-k", self.dir]
            + ["-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        import psycopg

        deadline = time.monotonic() + 20
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=1).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGINT) -> None:
        """SIGINT: fast shutdown (sessions ended, data kept); SIGKILL: a crash.

        Sent to the process group: the postmaster runs under ``runuser`` when we are root.
        """
        if self.process is not None and self.process.poll() is None:
            kill_tree(self.process, sig)
            self.process.wait(20)
            deadline = time.monotonic() + 20
            while os.path.exists(os.path.join(self.data, "postmaster.pid")):
                if sig == signal.SIGKILL or time.monotonic() > deadline:
                    kill_tree(self.process, signal.SIGKILL)
                    break
                time.sleep(0.05)
        self.process = None

    def cleanup(self) -> None:
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


class PortTaken(RuntimeError):
    """A server exited at start because another process holds one of its ports."""


class EtcdServer:
    """A one-member ``etcd`` of the test's own (Debian's ``etcd-server``) on free ports,
    its data kept across restarts. Short raft timings make its smallest lease ttl one
    second (etcd's minimum is 1.5 election ticks x heartbeat, rounded up)."""

    def __init__(self) -> None:
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("etcd is not installed: apt-get install etcd-server")
        self.port, self.peer_port = free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="exclusive-etcd-")
        self.process: subprocess.Popen | None = None
        #: Whether it ever answered: from then on its ports are its address.
        self.started = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def start(self) -> None:
        """Start the member and wait until it answers. On its first start only, ports
        that another process took between :func:`free_port` and etcd's bind (the tests
        run in parallel) are traded for fresh ones; a restart keeps its ports."""
        for _ in range(3):
            try:
                return self._start()
            except PortTaken:
                if self.started:
                    raise
                self.port, self.peer_port = free_port(), free_port()
        return self._start()

    def _start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://{self.endpoint}"
        self.process = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", f"{self.dir}/data"]
            + ["--listen-client-urls", client, "--advertise-client-urls", client]
            + ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
            + ["--initial-cluster", f"test={peer}"]
            + ["--heartbeat-interval", "10", "--election-timeout", "100"],
            stdout=subprocess.DEVNULL,
            stderr=open(f"{self.dir}/log", "ab"),  # noqa: SIM115 - the child keeps it
            start_new_session=True,
        )
        import requests

        deadline = time.monotonic() + 20
        while True:
            try:
                answer = requests.post(f"{client}/v3/kv/range", json={"key": "AA=="}, timeout=1)
                if answer.status_code == 200:
                    self.started = True
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                log = Path(self.dir, "log").read_text(errors="replace")[-2000:]
                if self.process.poll() is not None and "address already in use" in log:
                    raise PortTaken(log)
                raise RuntimeError(f"etcd did not start: {log}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(20)
        self.process = None

    def cleanup(self) -> None:
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


class PgBouncer:
    """PgBouncer (Debian's) in transaction mode in front of a PostgresServer, with one
    server connection for everyone: clients take turns on it between transactions, so
    anything a client leaves on its session shows up in another client's."""

    def __init__(self, postgres: PostgresServer) -> None:
        self.binary = "/usr/sbin/pgbouncer"
        if not os.path.exists(self.binary):
            raise RuntimeError("PgBouncer is not installed: apt-get install pgbouncer")
        self.postgres = postgres
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="exclusive-pgbouncer-")
        os.chmod(self.dir, 0o755)
        Path(self.dir, "users.txt").write_text(f'"postgres" "{postgres.password}"\n')
        Path(self.dir, "pgbouncer.ini").write_text(
            "[databases]\n"
            f"postgres = host=127.0.0.1 port={postgres.port} dbname=postgres\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir = {self.dir}\n"
            f"auth_type = plain\nauth_file = {self.dir}/users.txt\n"
            "pool_mode = transaction\ndefault_pool_size = 1\nmax_client_conn = 50\n"
            f"logfile = {self.dir}/log\npidfile = {self.dir}/pid\n"
        )
        if os.geteuid() == 0:
            for name in ("", "users.txt", "pgbouncer.ini"):
                shutil.chown(os.path.join(self.dir, name), "postgres", "postgres")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.postgres.url_for(port=self.port)

    def start(self) -> PgBouncer:
        self.process = subprocess.Popen(
            [*_as_postgres_user(), self.binary, f"{self.dir}/pgbouncer.ini"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return self
            if time.monotonic() > deadline:
                raise RuntimeError("PgBouncer did not start")
            time.sleep(0.05)

    def cleanup(self) -> None:
        if self.process is not None:
            kill_tree(self.process, signal.SIGKILL)
            self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class TLSFiles:
    """A private CA made with ``openssl``, and a server certificate it signed for
    127.0.0.1 (as IP and DNS name), so that clients verify it with hostname checks on."""

    def __init__(self, directory: str, name: str = "ca") -> None:
        self.dir = directory
        self.ca, self.ca_key = f"{directory}/{name}.crt", f"{directory}/{name}.key"
        self.cert, self.key = f"{directory}/{name}-server.crt", f"{directory}/{name}-server.key"
        ext = f"{directory}/{name}-san.ext"
        with open(ext, "w") as out:
            out.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        run = [shutil.which("openssl") or "openssl"]
        commands = [
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj"]
            + [f"/CN=celery-exclusive test {name}", "-keyout", self.ca_key, "-out", self.ca],
            ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1"]
            + ["-keyout", self.key, "-out", f"{directory}/{name}-server.csr"],
            ["x509", "-req", "-in", f"{directory}/{name}-server.csr", "-CA", self.ca]
            + ["-CAkey", self.ca_key, "-CAcreateserial", "-days", "2", "-out", self.cert]
            + ["-extfile", ext],
        ]
        for command in commands:
            subprocess.run(run + command, check=True, capture_output=True)

    def server_args(self) -> list[str]:
        return [
            "--tls-cert-file",
            self.cert,
            "--tls-key-file",
            self.key,
            "--tls-ca-cert-file",
            self.ca,
            "--tls-auth-clients",
            "no",
        ]


class RedisClusterServers:
    """Three ``redis-server --cluster-enabled yes`` masters joined by ``redis-cli
    --cluster create``: a real 3-master Redis Cluster, slots spread over all three."""

    def __init__(self, masters: int = 3) -> None:
        self.nodes = [
            RedisServer(
                extra=("--cluster-enabled", "yes", "--cluster-node-timeout", "2000")
                + ("--cluster-config-file", f"nodes-{i}.conf")
                # The bus port defaults to port + 10000, past 65535 for high free ports.
                + ("--cluster-port", str(free_port()))
            )
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [shutil.which("redis-cli") or "redis-cli", "--cluster", "create"]
            + [f"127.0.0.1:{node.port}" for node in self.nodes]
            + ["--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all(
            b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO") for n in self.nodes
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster never reached cluster_state:ok")
            time.sleep(0.1)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


class RedisSentinels:
    """A master, a replica and three ``redis-server --sentinel`` processes watching them,
    all on free loopback ports, with the failover timings kept short for tests.

    With ``user``/``password`` the data nodes admit that ACL user (replication and the
    sentinels use it too); with ``sentinel_password`` the sentinels ask for their own.
    """

    service = "leases"

    def __init__(
        self,
        down_after_ms: int = 1000,
        user: str | None = None,
        password: str | None = None,
        sentinel_password: str | None = None,
        tls: TLSFiles | None = None,
    ) -> None:
        self.user, self.password, self.sentinel_password = user, password, sentinel_password
        #: Every link over TLS (clients, replication, sentinels) when set.
        self.tls = tls
        auth: tuple = ("--repl-diskless-sync-delay", "0")  # a replica syncs at once
        if user:
            auth += ("--user", user, "on", f">{password}", "~*", "&*", "+@all")
            auth += ("--masteruser", user, "--masterauth", password)
        if tls:
            auth += ("--tls-replication", "yes")
        self.master = RedisServer(extra=auth, tls=tls)
        self.replica = RedisServer(extra=auth, tls=tls)
        self.replica.extra += ("--replicaof", "127.0.0.1", str(self.master.port))
        self.down_after_ms = down_after_ms
        self.ports = [free_port() for _ in range(3)]
        self.dir = tempfile.mkdtemp(prefix="exclusive-sentinel-")
        self.processes: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        login = f"{self.user}:{self.password}@" if self.user else ""
        options = []
        if self.sentinel_password:
            options.append(f"sentinel_password={self.sentinel_password}")
        if self.tls:
            options.append(f"ssl_ca_certs={self.tls.ca}")
        scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
        query = "?" + "&".join(options) if options else ""
        return f"{scheme}://{login}{hosts}/{self.service}/0{query}"

    def start(self) -> None:
        self.master.start()
        self.replica.start()
        for port in self.ports:
            conf = f"{self.dir}/sentinel-{port}.conf"
            listen = [f"port {port}"]
            if self.tls:  # the server's --name value pairs, as config lines
                args = self.tls.server_args()
                listen = ["port 0", f"tls-port {port}", "tls-replication yes"]
                listen += [f"{name[2:]} {value}" for name, value in zip(args[::2], args[1::2])]
            lines = [
                *listen,
                "bind 127.0.0.1",
                f"dir {self.dir}",
                f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 2",
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                f"sentinel failover-timeout {self.service} 4000",
                f"sentinel parallel-syncs {self.service} 1",
            ]
            if self.user:
                lines += [f"sentinel auth-user {self.service} {self.user}"]
                lines += [f"sentinel auth-pass {self.service} {self.password}"]
            if self.sentinel_password:
                lines += [f"requirepass {self.sentinel_password}"]
            with open(conf, "w") as out:
                out.write("\n".join(lines) + "\n")
            self.processes.append(
                subprocess.Popen(
                    [shutil.which("redis-server"), conf, "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self.wait_until(
            lambda: all(
                int(self.sentinel(i).sentinel_master(self.service)["num-other-sentinels"]) == 2
                and int(self.sentinel(i).sentinel_master(self.service)["num-slaves"]) == 1
                for i in range(3)
            ),
            "sentinels to know each other and the replica",
        )
        self.wait_until(
            lambda: (
                self.data_client(self.replica.port).info("replication")["master_link_status"]
                == "up"
            ),
            "the replica to sync",
        )

    def sentinel(self, index: int = 0) -> redis.Redis:
        return redis.Redis(
            port=self.ports[index],
            password=self.sentinel_password,
            socket_timeout=2,
            socket_connect_timeout=1,
            **self._tls_kwargs(),
        )

    def _tls_kwargs(self) -> dict:
        return {"ssl": True, "ssl_ca_certs": self.tls.ca} if self.tls else {}

    def master_port(self) -> int:
        return int(self.sentinel().sentinel_get_master_addr_by_name(self.service)[1])

    def wait_settled(self, timeout: float = 60) -> None:
        """Until every sentinel agrees on the master and sees the other node as its
        replica with the link up, and that replica has synced: a failover can then
        start (Sentinel refuses one while another is recent or no replica is good)."""
        master = self.master_port()
        other = self.replica.port if self.master.port == master else self.master.port

        def settled() -> bool:
            for i in range(len(self.ports)):
                sentinel = self.sentinel(i)
                if int(sentinel.sentinel_get_master_addr_by_name(self.service)[1]) != master:
                    return False
                replicas = sentinel.sentinel_slaves(self.service)
                if not any(
                    int(r["port"]) == other
                    and r["master-link-status"] == "ok"
                    and not r["is_sdown"]
                    and not r["is_disconnected"]
                    for r in replicas
                ):
                    return False
            replication = self.data_client(other).info("replication")
            return replication.get("master_port") == master and (
                replication.get("master_link_status") == "up"
            )

        self.wait_until(settled, "the sentinels to settle", timeout)

    def failover(self, timeout: float = 60) -> int:
        """``SENTINEL FAILOVER``, asked again while a sentinel refuses it; returns the
        new master's port once the sentinels announce it."""
        old = self.master_port()

        def switched() -> bool:
            if self.master_port() != old:
                return True
            with contextlib.suppress(redis.ResponseError):
                self.sentinel().execute_command("SENTINEL", "FAILOVER", self.service)
            time.sleep(0.2)
            return self.master_port() != old

        self.wait_until(switched, "a switch of master", timeout)
        return self.master_port()

    def node(self, port: int) -> RedisServer:
        return self.master if self.master.port == port else self.replica

    def data_client(self, port: int) -> redis.Redis:
        return redis.Redis(
            port=port,
            username=self.user,
            password=self.password,
            socket_timeout=2,
            **self._tls_kwargs(),
        )

    def wait_until(self, predicate, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if predicate():
                    return
            except (redis.RedisError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.02)

    def cleanup(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        self.master.cleanup()
        self.replica.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)
