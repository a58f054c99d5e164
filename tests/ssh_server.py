"""An SSH server and a Unix user of a test's own, so `ray up` with Ray's
`local` provider can treat this machine as a remote node (tests/test_deploy.py).

The cluster's commands run as a user made for the test, with its home in
the test's temp dir: `ray stop` in the start commands kills every Ray
process its user may signal, and the setup writes ~/.bashrc and
~/rayvllm-venv, so neither may run as the user who runs the tests. The
server runs as root (it has to become that user) on a free loopback port,
with its own config, host key and PID file, and lets in only that user
with the test's fresh key.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

from rayvllm.entrypoints.serve_builder import port_listening
from rayvllm.utils.network import free_port

from process_state import descendant_pids

APT_TIMEOUT_S = 600
SSHD = "/usr/sbin/sshd"


def ensure_debian_packages(commands: dict[str, str]) -> None:
    """Install the Debian package of each missing command (`{command: package}`);
    the package lists are fetched only when an install without them fails."""
    missing = sorted({pkg for cmd, pkg in commands.items() if not (shutil.which(cmd) or Path(cmd).exists())})
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if subprocess.run(install, env=env, capture_output=True, timeout=APT_TIMEOUT_S).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=True, timeout=APT_TIMEOUT_S)
        subprocess.run(install, env=env, capture_output=True, check=True, timeout=APT_TIMEOUT_S)


def pids_of_uid(uid: int) -> list[int]:
    """Live processes whose real user is `uid` (read from /proc)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = {k: v for k, _, v in (line.partition(":") for line in status.read_text().splitlines())}
        except OSError:
            continue  # it ended while we looked
        if int(fields["Uid"].split()[0]) == uid and fields.get("State", "").split()[:1] != ["Z"]:
            found.append(int(status.parent.name))
    return found


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class NodeUser:
    """A Unix user made for one test, home `home`; `remove` kills what it
    still runs (by pid, found by its uid) and deletes it."""

    NAME = "rayvllm-deploy"

    def __init__(self, home: Path) -> None:
        self.name = self.NAME
        self.home = home
        self.remove()  # what a killed earlier run may have left
        # Password "*": no password login, but not a locked account either
        # (sshd refuses locked accounts even their keys).
        subprocess.run(
            ["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/bash",
             "--user-group", "--password", "*", self.name],
            check=True, capture_output=True, timeout=60,
        )
        entry = pwd.getpwnam(self.name)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid

    def write(self, relative: str, text: str, mode: int = 0o644) -> Path:
        """A file in the user's home, owned by the user (parents too)."""
        path = self.home / relative
        for parent in reversed(path.relative_to(self.home).parents[:-1]):
            (self.home / parent).mkdir(exist_ok=True)
            os.chown(self.home / parent, self.uid, self.gid)
        path.write_text(text)
        path.chmod(mode)
        os.chown(path, self.uid, self.gid)
        return path

    def own(self, path: Path) -> None:
        """`path` and everything under it belong to the user."""
        subprocess.run(["chown", "-R", f"{self.name}:{self.name}", str(path)], check=True, timeout=120)

    def processes(self) -> list[int]:
        return pids_of_uid(self.uid)

    def remove(self) -> None:
        try:
            uid = pwd.getpwnam(self.NAME).pw_uid
        except KeyError:
            return
        kill_pids(pids_of_uid(uid))
        deadline = time.monotonic() + 30
        while pids_of_uid(uid) and time.monotonic() < deadline:
            time.sleep(0.2)  # the kernel reaps SIGKILLed processes on its own clock
        subprocess.run(["userdel", self.NAME], check=True, capture_output=True, timeout=60)


class SSHServer:
    """sshd on 127.0.0.1:`port` (a free port) letting `user` in with the key
    at `private_key`. Invariant after `stop`: the server and every session
    it forked are gone."""

    def __init__(self, workdir: Path, user: NodeUser) -> None:
        self.workdir = workdir
        self.private_key = workdir / "id_ed25519"
        host_key = workdir / "ssh_host_ed25519_key"
        for key in (self.private_key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=60)
        user.write(".ssh/authorized_keys", self.private_key.with_suffix(".pub").read_text(), mode=0o600)
        (user.home / ".ssh").chmod(0o700)
        self.port = free_port()
        config = workdir / "sshd_config"
        config.write_text(
            f"Port {self.port}\n"
            "ListenAddress 127.0.0.1\n"
            f"HostKey {host_key}\n"
            f"PidFile {workdir / 'sshd.pid'}\n"
            "AuthorizedKeysFile .ssh/authorized_keys\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "PermitRootLogin no\n"
            f"AllowUsers {user.name}\n"
            # Ray multiplexes its commands over one connection.
            "MaxSessions 32\n"
            "LogLevel VERBOSE\n"
        )
        # The privilege-separation directory that systemd would make.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        self.log_path = workdir / "sshd.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        # -D: stay in the foreground, so this is the server's pid; -e: log to the file.
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not port_listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sshd did not start:\n{self.log_tail()}")
            time.sleep(0.1)  # polling a server that is still starting

    @property
    def proxy_command(self) -> str:
        """What ssh runs instead of connecting itself (Ray's `ssh_proxy_command`):
        the server is not on port 22."""
        return f"nc 127.0.0.1 {self.port}"

    def check_login(self, user: NodeUser) -> None:
        """One command over SSH as `user`, so a refused login fails here, with
        the server's log, not after `ray up`'s long wait for SSH."""
        argv = ["ssh", "-i", str(self.private_key), "-o", f"ProxyCommand={self.proxy_command}",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
                f"{user.name}@127.0.0.1", "true"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"ssh login failed: {result.stderr}\nsshd:\n{self.log_tail()}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        kill_pids(descendant_pids(self.proc.pid))  # the sessions it forked
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
