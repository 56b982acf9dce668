"""`socket_group` as shipped: the daemon started the way the systemd unit
(with its drop-in services/cpcached/socket-group.conf) and compose start
it, three users apart. The daemon's user serves; a user in the group reaches
both sockets (Health, Status, the identity on `.pools`) through the run
directory but cannot write there; a user outside the group is refused at
connect. Every mode, user and group comes from the shipped files (unit,
drop-in, rank.toml.example, Dockerfile, compose.yaml), never retyped; only
their names are mapped onto a group and uids made for the test."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from cpcache.client import Client
from cpcache.daemon.listeners import closed_to_group, warn_if_closed_to_group
from cpcache.daemon.server import ExitCode
from cpcache.testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "services" / "cpcached"
PEER = Path(__file__).with_name("socket_peer.py")
pytestmark = pytest.mark.timeout(150)

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("setpriv", "groupadd", "groupdel")),
    reason="three users and a group of the test's own need root, setpriv, groupadd and groupdel")


# -- the shipped files ------------------------------------------------------------------------------


def unit_service(*paths: Path) -> dict[str, list[str]]:
    """The [Service] settings of a unit and its drop-ins, applied in order
    as systemd applies them: a later assignment replaces a single-valued
    setting; list settings (SupplementaryGroups=) accumulate, and an empty
    assignment clears them."""
    settings: dict[str, list[str]] = {}
    for path in paths:
        section = ""
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line
                continue
            if section != "[Service]":
                continue
            key, _, value = line.partition("=")
            if key in ("SupplementaryGroups",):
                settings[key] = [*settings.get(key, []), *value.split()] if value else []
            else:
                settings[key] = [value]
    return {key: values for key, values in settings.items()}


def one(settings: dict[str, list[str]], key: str) -> str:
    return settings[key][-1]


def the_unit() -> dict[str, list[str]]:
    return unit_service(SERVICES / "cpcached@.service", SERVICES / "socket-group.conf")


def dockerfile_run_dir() -> tuple[str, int, str, int]:
    """From the Dockerfile's base stage: (the client group's name, its gid,
    /run/cpcache's group, its mode)."""
    text = (SERVICES / "Dockerfile").read_text().replace("\\\n", " ")
    group = re.search(r"groupadd --system --gid (\d+) (\S+)", text)
    run_dir = re.search(r"install -d -o cpcache -g (\S+) -m (\d+) /run/cpcache(?: |$)", text, re.M)
    assert group and run_dir, "the Dockerfile makes no client group or no /run/cpcache of its own"
    return group.group(2), int(group.group(1)), run_dir.group(1), int(run_dir.group(2), 8)


def compose_daemons() -> dict[str, dict]:
    services = YAML(typ="safe").load((REPO / "compose.yaml").read_text())["services"]
    return {name: svc for name, svc in services.items() if re.fullmatch(r"cpu-rank-\d+|cpcached-\d+", name)}


def test_the_drop_in_the_example_the_image_and_compose_name_one_group():
    """The drop-in's Group= is the group rank.toml.example shares its socket
    with, the group the image gives /run/cpcache, and the group every
    compose daemon runs with and shares its sockets with; the unit's
    RuntimeDirectoryMode= and the image's mode agree: the group enters, only
    the daemon writes, others are kept out."""
    unit = the_unit()
    group = one(unit, "Group")
    assert group != one(unit_service(SERVICES / "cpcached@.service"), "Group")  # the drop-in changes it
    assert "services/cpcached/socket-group.conf" in (SERVICES / "cpcached@.service").read_text()  # the unit names it
    example = tomllib.loads((SERVICES / "rank.toml.example").read_text())
    assert example["socket_group"] == group
    assert example["socket"].startswith(f"/run/{one(unit, 'RuntimeDirectory')}/")
    mode = int(one(unit, "RuntimeDirectoryMode"), 8)
    assert mode & 0o070 == 0o050 and not mode & 0o007 and mode & 0o700 == 0o700
    name, gid, run_group, run_mode = dockerfile_run_dir()
    assert name == group == run_group and run_mode == mode
    daemons = compose_daemons()
    assert len(daemons) == 6
    for service, svc in daemons.items():
        assert svc["user"] == f"10001:{gid}", service
        assert svc["environment"]["CPCACHE_SOCKET_GROUP"] == group, service
    # What an operator copies is what the tests run.
    operations = (REPO / "docs" / "operations.md").read_text()
    assert "[Service]\n    Group=cpcache-clients\n" in operations and f"Group={group}" in operations
    assert f'user: "10001:{gid}"' in operations and f'group_add: ["{gid}"]' in operations


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_unit_with_its_drop_in_verifies(tmp_path):
    unit = (SERVICES / "cpcached@.service").read_text()
    instance = tmp_path / "cpcached@0.service"
    daemon = str(Path(sys.executable).with_name("cpcached"))
    instance.write_text(unit.replace("/opt/cpcache/.venv/bin/cpcached", daemon))
    (tmp_path / "cpcached@0.service.d").mkdir()
    shutil.copy(SERVICES / "socket-group.conf", tmp_path / "cpcached@0.service.d" / "socket-group.conf")
    result = subprocess.run(["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_a_directory_the_group_cannot_enter_is_named(caplog):
    """The daemon warns when its socket's directory (or one above it) is
    closed to `socket_group` by its mode bits: the group's members would be
    refused at connect."""
    base = Path(tempfile.mkdtemp(prefix="cpc-closed-"))
    try:
        run_dir = base / "run"
        run_dir.mkdir()
        own = os.getegid()
        other = next(g.gr_gid for g in grp.getgrall() if g.gr_gid != own)
        sock = str(run_dir / "rank-0.sock")
        base.chmod(0o755)
        run_dir.chmod(0o750)
        assert closed_to_group(sock, own) == "" and closed_to_group(sock, other) == str(run_dir)
        run_dir.chmod(0o751)  # searchable by everyone
        assert closed_to_group(sock, other) == ""
        base.chmod(0o750)  # a directory above it
        assert closed_to_group(sock, other) == str(base)
        name = grp.getgrgid(other).gr_name
        with caplog.at_level("WARNING", logger="cpcached"):
            warn_if_closed_to_group(sock, name)
        assert f"socket_group {name} cannot enter {base}" in caplog.text and f"Group={name}" in caplog.text
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- three users and a group ------------------------------------------------------------------------


@dataclass
class People:
    group: str  # the socket group, made for the test
    gid: int
    daemon: int  # the daemon's uid
    member: int  # another uid, in the group: the SGLang server's
    outsider: int  # a third uid, not in the group


def free_uids(n: int) -> list[int]:
    uids: list[int] = []
    for uid in range(61000 + os.getpid() % 2000, 65000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            uids.append(uid)
            if len(uids) == n:
                return uids
    raise AssertionError("no free uids")


@pytest.fixture
def people() -> Iterator[People]:
    name = f"cpct-{uuid.uuid4().hex[:8]}"
    subprocess.run(["groupadd", "--system", name], check=True, capture_output=True, timeout=60)
    try:
        daemon, member, outsider = free_uids(3)
        yield People(name, grp.getgrnam(name).gr_gid, daemon, member, outsider)
    finally:
        subprocess.run(["groupdel", name], check=False, capture_output=True, timeout=60)


@dataclass
class Start:
    """How one daemon is started: its identity, umask and capabilities, its
    run directory's owner and mode, its command and environment."""

    uid: int
    gid: int
    groups: list[int]
    umask: int
    run_dir: Path
    dir_mode: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    no_new_privs: bool = False
    no_caps: bool = False

    def argv(self) -> list[str]:
        flags = [f"--reuid={self.uid}", f"--regid={self.gid}",
                 f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"]
        if self.no_new_privs:
            flags.append("--no-new-privs")
        if self.no_caps:
            flags += ["--inh-caps=-all", "--bounding-set=-all"]
        return ["setpriv", *flags, *self.command]


def as_user(uid: int, gid: int, groups: tuple[int, ...], *command: str) -> list[str]:
    group_flag = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", group_flag, "--inh-caps=-all", *command]


def prepare_runtime_dir(path: Path, mode: int, uid: int, gid: int) -> None:
    """What systemd does with RuntimeDirectory= at every start of a unit
    (exec_directory setup): create it, set its mode, and chown the whole
    tree to the unit's User:Group when the top is not theirs already, the
    sockets of other instances sharing it included."""
    path.mkdir(mode=mode, exist_ok=True)
    path.chmod(mode)
    info = path.stat()
    if (info.st_uid, info.st_gid) == (uid, gid):
        return
    for root, dirs, files in os.walk(path):
        for entry in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.chown(entry, uid, gid, follow_symlinks=False)


def group_ids(names: list[str]) -> list[int]:
    """Supplementary groups this machine has (video and render need not exist here)."""
    found = []
    for name in names:
        with contextlib.suppress(KeyError):
            found.append(grp.getgrnam(name).gr_gid)
    return found


def systemd_start(base: Path, people: People) -> Start:
    """The unit with its drop-in: User= is the test's daemon uid, the
    drop-in's Group= the test's group, and the rank's settings are
    rank.toml.example's socket and socket_group (under the test's run
    directory and group)."""
    unit = the_unit()
    group = one(unit, "Group")
    run_dir = base / one(unit, "RuntimeDirectory")
    example = tomllib.loads((SERVICES / "rank.toml.example").read_text())
    socket_path = example["socket"].replace(f"/run/{one(unit, 'RuntimeDirectory')}", str(run_dir))
    assert example["socket_group"] == group
    config = base / "etc" / "rank-0.toml"
    config.parent.mkdir(mode=0o755)
    config.write_text(f'socket = "{socket_path}"\nsocket_group = "{people.group}"\nhost_store = true\n'
                      f'rendezvous = "127.0.0.1:{free_port()}"\ndeployment = "socket-group-test"\n')
    config.chmod(0o644)
    words = one(unit, "ExecStart").replace("%i", "0").split()
    words[0] = str(Path(sys.executable).with_name("cpcached"))
    command = [str(config) if w == "/etc/cpcache/rank-0.toml" else w for w in words]
    assert str(config) in command
    return Start(uid=people.daemon, gid=people.gid, groups=group_ids(unit.get("SupplementaryGroups", [])),
                 umask=int(one(unit, "UMask"), 8), run_dir=run_dir, dir_mode=int(one(unit, "RuntimeDirectoryMode"), 8),
                 command=command, no_new_privs=one(unit, "NoNewPrivileges") == "yes",
                 no_caps=one(unit, "CapabilityBoundingSet") == "")


def compose_start(base: Path, people: People) -> Start:
    """A compose daemon: the image's /run/cpcache (its owner, group and mode)
    on the volume, the service's `user:` (uid 10001 is the test's daemon
    uid, the image's client gid the test's group), its CPCACHE_SOCKET and
    CPCACHE_SOCKET_GROUP, a container's default umask."""
    name, gid, _, mode = dockerfile_run_dir()
    svc = compose_daemons()["cpu-rank-0"]
    uid_gid = svc["user"].split(":")
    assert uid_gid == ["10001", str(gid)]
    env = svc["environment"]
    assert env["CPCACHE_SOCKET_GROUP"] == name
    run_dir = base / "cpcache"
    socket_path = env["CPCACHE_SOCKET"].replace("/run/cpcache", str(run_dir))
    command = [str(Path(sys.executable).with_name("cpcached")), "--rank", "0", "--host-store",
               "--rendezvous", f"127.0.0.1:{free_port()}", "--deployment", "socket-group-test"]
    return Start(uid=people.daemon, gid=people.gid, groups=[], umask=0o022, run_dir=run_dir, dir_mode=mode,
                 command=command, env={"CPCACHE_SOCKET": socket_path, "CPCACHE_SOCKET_GROUP": people.group})


def peer(sock: str, uid: int, gid: int, groups: tuple[int, ...] = ()) -> dict:
    result = subprocess.run(as_user(uid, gid, groups, sys.executable, str(PEER), sock), capture_output=True,
                            text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@needs_root
@pytest.mark.parametrize("how", ["systemd", "compose"])
def test_the_socket_group_and_only_it_reaches_the_daemon(people, how):
    base = Path(tempfile.mkdtemp(prefix="cpc-group-"))
    base.chmod(0o755)
    proc = None
    log = base / "daemon.log"
    try:
        start = (systemd_start if how == "systemd" else compose_start)(base, people)
        prepare_runtime_dir(start.run_dir, start.dir_mode, start.uid, people.gid)
        sock = str(start.run_dir / "rank-0.sock")
        env = {**os.environ, "HOME": "/nonexistent", **start.env}
        with open(log, "wb") as out:
            proc = subprocess.Popen(start.argv(), stdout=out, stderr=subprocess.STDOUT, env=env, umask=start.umask)
        with Client(sock) as client:
            client.wait_serving(90)
        assert proc.poll() is None, log.read_text()

        # (1) The daemon serves; both sockets 0660 with the group, its run directory the group's to enter only.
        for path in (sock, sock + ".pools"):
            info = os.lstat(path)
            assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (people.daemon, people.gid, 0o660), path
        info = start.run_dir.stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o7777) == (people.daemon, people.gid, start.dir_mode)
        assert "cannot enter" not in log.read_text()

        # (2) Another uid in the group: both sockets, Health, Status, the daemon's identity; no writing there.
        member = peer(sock, people.member, people.member, (people.gid,))
        assert member["grpc_connect"] == member["pools_connect"] == "ok", member
        assert member["health"] == "SERVING" and member["status"] == "serving", member
        assert member["identity_pid"] == proc.pid, member
        assert member["write_dir"] == "EACCES", member

        # (3) A third uid, not in the group: refused at connect, on both sockets.
        outsider = peer(sock, people.outsider, people.outsider)
        assert outsider["grpc_connect"] == outsider["pools_connect"] == "EACCES", outsider
        assert outsider["health"].startswith("UNAVAILABLE") and "Permission denied" in outsider["health"], outsider
        assert "Permission denied" in outsider["status"], outsider
        assert "Permission denied" in str(outsider["identity_pid"]), outsider
        assert outsider["write_dir"] == "EACCES", outsider

        if how == "systemd":
            # Another instance of the unit starts: systemd prepares the shared run directory again;
            # this daemon's sockets keep their group.
            prepare_runtime_dir(start.run_dir, start.dir_mode, start.uid, start.gid)
            again = peer(sock, people.member, people.member, (people.gid,))
            assert again["grpc_connect"] == again["pools_connect"] == "ok" and again["health"] == "SERVING", again
    finally:
        if proc is not None:
            proc.terminate()
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            assert code == ExitCode.STOPPED, log.read_text()[-4000:]
        shutil.rmtree(base, ignore_errors=True)
