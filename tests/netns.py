"""Test hosts as Linux network namespaces, each with its own address on a private bridge.

The test process stays in the root namespace, which is host "A" (the bridge's address); every
extra host is a namespace joined to the bridge by a veth pair. Processes started with
``ip netns exec NAME ...`` see only their host's address and loopback, so a job that spans
them talks over real routed sockets, as across machines. Needs root and ``ip``.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess


def available() -> str | None:
    """None if namespaces can be made here, else why not (the reason a test is skipped)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    try:
        with TestNet(1):
            pass
    except subprocess.CalledProcessError as exc:
        return f"cannot create network namespaces, bridges or veth pairs: {exc.stderr or exc}"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class TestNet:
    """A bridge with address ``<prefix>.1`` (host A) and ``n`` namespaces ``<prefix>.11``, ``.12``, ..."""

    __test__ = False  # not a pytest test class

    def __init__(self, n: int) -> None:
        tag = secrets.token_hex(2)
        self.prefix = f"10.213.{random.randrange(1, 250)}"
        self.bridge = f"lzb{tag}"
        self.hosts = [f"lzh{tag}{i}" for i in range(n)]
        self.addrs = [f"{self.prefix}.{11 + i}" for i in range(n)]
        self.root_addr = f"{self.prefix}.1"

    def __enter__(self) -> TestNet:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.root_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (ns, addr) in enumerate(zip(self.hosts, self.addrs, strict=True)):
                outer, inner = f"{self.bridge}v{i}", f"{self.bridge}n{i}"
                subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("link", "set", inner, "netns", ns)
                _ip("addr", "add", f"{addr}/24", "dev", inner, ns=ns)
                _ip("link", "set", inner, "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.hosts:
            # processes still inside would keep the namespace's devices: kill them first
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def popen(self, host: int, cmd: list[str], **kw: object) -> subprocess.Popen[bytes]:
        """Start a command on host ``host`` (0-based index of the namespaces)."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[host], *cmd], **kw)  # type: ignore[call-overload]
