"""The deployment files (deploy/): `make install` with DESTDIR/PREFIX lays out exactly the expected files
with the right modes, the systemd unit passes `systemd-analyze verify` and carries its hardening, the
Dockerfile is linted statically (no Docker engine here: stages, user, volume, health check, every
package exists in Debian bookworm, the runtime packages cover the binaries' shared libraries, and the
files it copies are enough for `make all`), the man pages render without a groff warning and document
every option and command the binaries' --help lists, and nginx-tls.conf is run by the real nginx with a
self-signed certificate in front of a real dilocod: status over TLS, a streamed 10 MiB delta upload,
the aggregated global downloaded back (with a Range request), /metrics, the HTTP->HTTPS redirect."""
import hashlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save as np_save

from conftest import BUILD, ROOT, run
from dilocod_proc import Dilocod, delta_metadata, write_model

DEPLOY = ROOT / "deploy"


# ---- helpers --------------------------------------------------------------------------------------

def make_vars():
    """make variables selecting the build directory the tests run against (DILOCO_BUILD): the default
    build/, a sanitizer variant (build-address-undefined -> SANITIZE=address,undefined, so that make
    does not rebuild it without the sanitizer flags), or any other directory (BUILD=...)."""
    build = BUILD.resolve()
    if build == (ROOT / "build").resolve():
        return []
    if build.parent == ROOT.resolve() and build.name.startswith("build-"):
        return [f"SANITIZE={build.name[len('build-'):].replace('-', ',')}"]
    return [f"BUILD={build}"]


def make_install(*args):
    p = run(["make", "-s", "-C", ROOT, "install", *make_vars(), *args])
    assert p.returncode == 0, f"make install {args} failed:\n{p.stdout}\n{p.stderr}"
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unit_settings(text: str) -> dict:
    """{key: [values]} of a unit file's assignments (comments and sections dropped)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;[":
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def render_man(path: Path) -> str:
    """The page as `man -l` shows it (plain text, 100 columns), with groff's Unicode minus and hyphen
    signs folded to ASCII."""
    p = run(["man", "-l", path], env=dict(os.environ, MANWIDTH="100", MAN_KEEP_FORMATTING="", PAGER="cat"))
    assert p.returncode == 0, p.stderr
    return p.stdout.replace("\u2212", "-").replace("\u2010", "-")


def long_options(help_text: str) -> list:
    return sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", help_text)))


def roff_escaped(option: str) -> str:
    """--state-root as written in roff source: \\-\\-state\\-root."""
    return option.replace("-", "\\-")


def sections(rendered: str) -> dict:
    """{SECTION NAME: text} of a rendered man page (section headings start in column 0)."""
    out, name = {}, None
    for line in rendered.splitlines():
        if re.match(r"^[A-Z][A-Z ]+$", line):
            name = line.strip()
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


# ---- make install ---------------------------------------------------------------------------------

EXPECTED_FILES = {
    "usr/sbin/dilocod": 0o755,
    "usr/bin/diloco": 0o755,
    "etc/dilocod/dilocod.conf": 0o644,
    "lib/systemd/system/dilocod.service": 0o644,
    "usr/share/man/man8/dilocod.8": 0o644,
    "usr/share/man/man1/diloco.1": 0o644,
    "usr/share/doc/dilocod/README.md": 0o644,
    "usr/share/doc/dilocod/nginx-tls.conf": 0o644,
}


@pytest.fixture(scope="module")
def destdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("destdir")
    make_install(f"DESTDIR={d}", "PREFIX=/usr")
    return d


def test_make_install_layout_and_modes(destdir):
    files = {str(p.relative_to(destdir)): p.stat().st_mode & 0o7777
             for p in destdir.rglob("*") if not p.is_dir()}
    assert files == EXPECTED_FILES, files
    for p in destdir.rglob("*"):
        assert not p.is_symlink(), p
        if p.is_dir():
            assert p.stat().st_mode & 0o7777 == 0o755, p
    # everything but the unit is installed verbatim
    for rel, src in [("usr/sbin/dilocod", BUILD / "dilocod"), ("usr/bin/diloco", BUILD / "diloco"),
                     ("etc/dilocod/dilocod.conf", ROOT / "config/dilocod.conf"),
                     ("usr/share/man/man8/dilocod.8", DEPLOY / "dilocod.8"),
                     ("usr/share/man/man1/diloco.1", DEPLOY / "diloco.1"),
                     ("usr/share/doc/dilocod/README.md", ROOT / "README.md"),
                     ("usr/share/doc/dilocod/nginx-tls.conf", DEPLOY / "nginx-tls.conf")]:
        assert (destdir / rel).read_bytes() == src.read_bytes(), rel


def test_installed_binaries_run(destdir):
    assert run([destdir / "usr/sbin/dilocod", "--version"], check=0).stdout.startswith("dilocod ")
    assert run([destdir / "usr/bin/diloco", "--version"], check=0).stdout.startswith("diloco ")
    # the installed configuration parses (it leaves the round size to the site: exit 2 without it)
    conf = destdir / "etc/dilocod/dilocod.conf"
    p = run([destdir / "usr/sbin/dilocod", "--config", conf, "--check-config"], check=2)
    assert "--expected-nodes" in p.stderr
    p = run([destdir / "usr/sbin/dilocod", "--config", conf, "--expected-nodes", "2", "--check-config"], check=0)
    assert "state_root = /var/lib/dilocod" in p.stdout


def test_installed_unit_points_at_installed_files(destdir):
    text = (destdir / "lib/systemd/system/dilocod.service").read_text()
    assert not re.search(r"@[A-Z]+@", text), "unsubstituted @VAR@ left in the unit"
    s = unit_settings(text)
    argv = shlex.split(s["ExecStart"][0])
    assert argv[0] == "/usr/sbin/dilocod" and (destdir / argv[0].lstrip("/")).is_file(), argv
    conf = argv[argv.index("--config") + 1]
    assert conf == "/etc/dilocod/dilocod.conf" and (destdir / conf.lstrip("/")).is_file(), argv
    # ExecStart's command line is one dilocod accepts (with the round size a site adds)
    args = [str(destdir) + a if a.startswith("/etc/") else a for a in argv[1:]]
    p = run([destdir / "usr/sbin/dilocod", *args, "--expected-nodes", "2", "--check-config"], check=0)
    assert "state_root = /var/lib/dilocod" in p.stdout


# ---- systemd --------------------------------------------------------------------------------------

REQUIRED_UNIT = {
    "Type": "simple", "NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes",
    "ProtectHome": "yes", "PrivateDevices": "yes", "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes",
    "ProtectClock": "yes", "ProtectHostname": "yes", "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "RestrictNamespaces": "yes", "RestrictRealtime": "yes", "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes", "MemoryDenyWriteExecute": "yes", "SystemCallArchitectures": "native",
    "CapabilityBoundingSet": "", "UMask": "0027", "ExecReload": "/bin/kill -HUP $MAINPID",
    "Restart": "on-failure", "RestartSec": "5", "LimitNOFILE": "65536", "StateDirectory": "dilocod",
    "ConfigurationDirectory": "dilocod", "After": "network-online.target", "WantedBy": "multi-user.target",
}


def test_unit_hardening_settings():
    s = unit_settings((DEPLOY / "dilocod.service").read_text())
    for key, want in REQUIRED_UNIT.items():
        assert want in s.get(key, []), (key, s.get(key))
    assert "@system-service" in s["SystemCallFilter"]
    assert s.get("DynamicUser") == ["yes"] or s.get("User", [""])[0] not in ("", "root")
    assert int(s["TimeoutStopSec"][0]) >= 120
    assert s["ExecStart"] == ["@SBINDIR@/dilocod --config @SYSCONFDIR@/dilocod/dilocod.conf "
                              "--state-root /var/lib/dilocod"]
    # the state root is the StateDirectory, writable under ProtectSystem=strict
    assert {"/var/lib/dilocod", "-/var/lib/dilocod"} & set(s.get("ReadWritePaths", [])), s.get("ReadWritePaths")


def test_unit_passes_systemd_analyze_verify(tmp_path):
    # Installed without DESTDIR under a PREFIX in tmp_path, so that every path the unit names exists
    # for real (systemd-analyze checks ExecStart's binary, and `man` finds the Documentation= pages).
    prefix, unitdir = tmp_path / "usr", tmp_path / "unit"
    make_install(f"PREFIX={prefix}", f"SYSCONFDIR={tmp_path}/etc", f"UNITDIR={unitdir}")
    unit = unitdir / "dilocod.service"
    s = unit_settings(unit.read_text())
    assert s["ExecStart"][0].split()[0] == f"{prefix}/sbin/dilocod"
    env = dict(os.environ, MANPATH=str(prefix / "share/man"), SYSTEMD_LOG_LEVEL="notice")
    p = run(["systemd-analyze", "verify", unit], env=env, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "dilocod" not in out, out

    # the check is live: a unit whose binary does not exist fails it
    broken = tmp_path / "broken" / "dilocod.service"
    broken.parent.mkdir()
    broken.write_text(unit.read_text().replace(f"{prefix}/sbin/dilocod", f"{prefix}/sbin/nonexistent"))
    p = run(["systemd-analyze", "verify", broken], env=env, cwd=tmp_path)
    assert p.returncode != 0 and "nonexistent" in p.stdout + p.stderr

    # informational: systemd's exposure score for the unit (lower is better)
    p = run(["systemd-analyze", "security", "--offline=true", "--no-pager", unit], env=env, cwd=tmp_path)
    score = re.search(r"Overall exposure level for \S+: (.*)", p.stdout + p.stderr)
    print(f"\nsystemd-analyze security: {score.group(1) if score else (p.stdout + p.stderr)[-500:]}")


# ---- Dockerfile -----------------------------------------------------------------------------------

def docker_instructions(text: str) -> list:
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue                # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def apt_packages(run_args: str) -> list:
    pkgs = []
    for m in re.finditer(r"apt-get\s+install\s+(.*?)(?:&&|;|$)", run_args):
        pkgs += [w for w in m.group(1).split() if not w.startswith("-")]
    return pkgs


@pytest.fixture(scope="module")
def docker_stages():
    ins = docker_instructions((DEPLOY / "Dockerfile").read_text())
    stages = []
    for word, args in ins:
        if word == "FROM":
            stages.append({"from": args, "ins": []})
        else:
            assert stages, f"{word} before the first FROM"
            stages[-1]["ins"].append((word, args))
    return stages


def test_dockerfile_structure(docker_stages):
    assert len(docker_stages) == 2, [s["from"] for s in docker_stages]
    build, runtime = docker_stages
    assert re.fullmatch(r"debian:bookworm-slim\s+AS\s+build", build["from"], re.I), build["from"]
    assert runtime["from"] == "debian:bookworm-slim", runtime["from"]

    build_runs = " ".join(a for w, a in build["ins"] if w == "RUN")
    assert re.search(r"\bmake\b[^&;]*\ball\b", build_runs), build_runs
    assert not re.search(r"\bmake\b[^&;]*\b(check|unit|test-integration)\b", build_runs), "the image runs no tests"

    rt = {}
    for w, a in runtime["ins"]:
        rt.setdefault(w, []).append(a)
    users = [u.split(":")[0] for u in rt["USER"]]
    assert users and users[-1] not in ("root", "0"), users
    assert any("/var/lib/dilocod" in v for v in rt["VOLUME"]), rt["VOLUME"]
    assert any(re.search(r"\b8470\b", e) for e in rt["EXPOSE"]), rt["EXPOSE"]
    hc = rt["HEALTHCHECK"][-1]
    assert "CMD" in hc and "diloco" in hc and "status" in hc and "http://127.0.0.1:8470" in hc, hc
    entry = rt["ENTRYPOINT"][-1]
    assert entry.startswith("["), "ENTRYPOINT in exec form (dilocod is PID 1 and gets SIGTERM)"
    assert "dilocod" in entry and '"--config"' in entry and '"0.0.0.0:8470"' in entry, entry
    copies = " ".join(rt["COPY"])
    assert "--from=build" in copies and "build/dilocod" in copies and "build/diloco " in copies + " "
    # the config the ENTRYPOINT names is copied into the image
    conf = re.search(r'"--config",\s*"([^"]+)"', entry).group(1)
    assert any(c.split()[-1] == conf for c in rt["COPY"]), (conf, rt["COPY"])


def test_dockerfile_packages_exist_in_bookworm(docker_stages):
    osr = Path("/etc/os-release").read_text()
    assert "VERSION_CODENAME=bookworm" in osr, "apt-cache here must answer for Debian bookworm"
    build = apt_packages(" ".join(a for w, a in docker_stages[0]["ins"] if w == "RUN"))
    runtime = apt_packages(" ".join(a for w, a in docker_stages[1]["ins"] if w == "RUN"))
    assert set(build) >= {"build-essential", "pkg-config", "libuv1-dev", "libcurl4-openssl-dev", "libcjson-dev",
                          "node-llhttp", "libssl-dev", "libexpat1-dev", "libxxhash-dev"}, build
    assert set(runtime) == {"libuv1", "libcurl4", "libcjson1", "libssl3", "libexpat1", "libxxhash0", "ca-certificates"}, runtime
    p = run(["apt-cache", "show", "--no-all-versions", *build, *runtime])
    for pkg in build + runtime:
        assert re.search(rf"(?m)^Package: {re.escape(pkg)}$", p.stdout), f"{pkg} is not a Debian package: {p.stderr}"
    assert p.returncode == 0, p.stderr


def test_dockerfile_runtime_packages_cover_the_binaries(docker_stages):
    """Every shared library dilocod and diloco link directly comes from a runtime-stage package (or
    libc6, which every Debian image holds)."""
    runtime = set(apt_packages(" ".join(a for w, a in docker_stages[1]["ins"] if w == "RUN"))) | {"libc6"}
    for binary in (BUILD / "dilocod", BUILD / "diloco"):
        dynamic = run(["readelf", "-d", binary], check=0).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
        resolved = dict(re.findall(r"^\s*(\S+) => (\S+)", run(["ldd", binary], check=0).stdout, re.M))
        for soname in needed:
            if soname.startswith("libclang_rt") or "asan" in soname or "ubsan" in soname or "tsan" in soname:
                continue        # sanitizer runtimes of an instrumented build
            where = os.path.dirname(resolved[soname]).removeprefix("/usr")
            owners = set()
            for line in run(["dpkg", "-S", f"*/{soname}"]).stdout.splitlines():
                pkg, _, path = line.partition(": ")
                if os.path.dirname(path).removeprefix("/usr") == where:
                    owners.add(pkg.split(":")[0])
            assert owners & runtime, f"{binary.name} needs {soname} from {owners}, not installed by the runtime stage"


def test_dockerfile_copies_enough_for_make_all(docker_stages, tmp_path):
    """The build stage copies only some paths of the checkout: those alone must build `make all`."""
    ctx = tmp_path / "src"
    ctx.mkdir()
    for w, a in docker_stages[0]["ins"]:
        if w != "COPY":
            continue
        *srcs, dst = a.split()
        assert not any(s.startswith("--") for s in srcs), a
        for src in srcs:
            s = ROOT / src
            assert s.exists(), f"COPY {src}: not in the repository"
            if s.is_dir():
                shutil.copytree(s, ctx / dst, dirs_exist_ok=True)
            else:
                shutil.copy2(s, ctx / dst / s.name if dst.endswith("/") or dst == "." else ctx / dst)
    assert not (ctx / "build").exists()
    # a plain build, as in the image: not the sanitizer variant a parent `make SANITIZE=...` exports
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "SANITIZE")}
    p = run(["make", "-s", "-C", ctx, f"-j{os.cpu_count() or 2}", "all"], env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for b in ("dilocod", "diloco"):
        assert run([ctx / "build" / b, "--version"], check=0).stdout.startswith(b + " ")


# ---- man pages ------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", ["dilocod.8", "diloco.1"])
def test_man_page_renders_without_warnings(page):
    path = DEPLOY / page
    p = run(["groff", "-man", "-Tutf8", "-ww", "-z", path])
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p.stderr
    for width in ("60", "80", "120"):
        p = run(["man", "--warnings=w", "-l", path], env=dict(os.environ, MANWIDTH=width, PAGER="cat"))
        assert p.returncode == 0 and p.stderr == "", (width, p.stderr)
    text = render_man(path)
    secs = sections(text)
    want = ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "FILES", "EXIT STATUS", "ENVIRONMENT", "EXAMPLES",
            "SEE ALSO"]
    if page == "dilocod.8":
        want.append("SIGNALS")
    for name in want:
        assert secs.get(name, "").strip(), f"{page}: section {name} missing or empty"
    for var in ("HF_TOKEN", "HF_ENDPOINT", "DILOCO_SERVER", "DILOCO_TOKEN"):
        assert var in secs["ENVIRONMENT"], (page, var)


def test_dilocod_man_page_documents_every_option():
    helptext = run([BUILD / "dilocod", "--help"], check=0).stdout
    opts = long_options(helptext)
    assert len(opts) >= 30, opts
    source = (DEPLOY / "dilocod.8").read_text()
    secs = sections(render_man(DEPLOY / "dilocod.8"))
    for opt in opts:
        assert roff_escaped(opt) in source, f"{opt} missing from dilocod.8"
        assert re.search(rf"^\s+{re.escape(opt)}\b", secs["OPTIONS"], re.M), f"{opt} has no entry in OPTIONS"
    for code in ("0", "1", "2"):
        assert re.search(rf"^\s+{code}\s", secs["EXIT STATUS"], re.M), code
    for sig in ("SIGTERM", "SIGINT", "SIGHUP"):
        assert sig in secs["SIGNALS"], sig
    # the keys of the shipped configuration file are the options
    keys = re.findall(r"(?m)^#?\s*([a-z_][a-z0-9_]*) = ", (ROOT / "config/dilocod.conf").read_text())
    for key in keys:
        assert "--" + key.replace("_", "-") in opts, f"config key {key} is not a --help option"


def test_diloco_man_page_documents_every_command_and_option():
    helptext = run([BUILD / "diloco", "--help"], check=0).stdout
    commands = re.findall(r"^  ([a-z][a-z-]*)\s", helptext.split("commands:")[1], re.M)    # verify-round
    assert len(commands) >= 8, commands
    source = (DEPLOY / "diloco.1").read_text()
    rendered = render_man(DEPLOY / "diloco.1")
    secs = sections(rendered)
    # one COMMANDS subsection per command, holding every option of its --help
    blocks = dict(re.findall(r"^   diloco ([a-z][a-z-]*)(?![\w-]).*\n((?:(?!   diloco ).*\n)*)", secs["COMMANDS"], re.M))
    for cmd in commands:
        assert cmd in blocks, f"command {cmd} has no COMMANDS subsection in diloco.1"
        assert re.search(rf"^\s+diloco {cmd}(?![\w-])", secs["SYNOPSIS"], re.M), f"{cmd} missing from SYNOPSIS"
        cmd_help = run([BUILD / "diloco", cmd, "--help"], check=0).stdout
        for opt in long_options(cmd_help):
            assert roff_escaped(opt) in source, f"diloco {cmd} {opt} missing from diloco.1"
            if opt != "--help":
                assert re.search(rf"^\s+(-\w, )?{re.escape(opt)}\b", blocks[cmd], re.M), \
                    f"diloco {cmd} {opt}: no entry in its COMMANDS subsection"
        for short in re.findall(r"(?<![\w-])(-[a-zA-Z])\b", cmd_help.split("\n")[0]):
            assert re.search(rf"^\s+{short}\b", blocks[cmd], re.M), f"diloco {cmd} {short} undocumented"
    for code in range(6):
        assert re.search(rf"^\s+{code}\s", secs["EXIT STATUS"], re.M), code


# ---- nginx ----------------------------------------------------------------------------------------

TOKEN = "token-aaaaaaaaaaaaaaaa"
NPARAMS = 10 * (1 << 20) // 4          # one F32 tensor: a 10 MiB delta


def test_nginx_conf_static():
    text = (DEPLOY / "nginx-tls.conf").read_text()
    code = re.sub(r"(?m)#.*$", "", text)
    for needle in ["proxy_request_buffering off;", "proxy_buffering off;", "proxy_http_version 1.1;",
                   'proxy_set_header Connection "";', "X-Forwarded-For $proxy_add_x_forwarded_for",
                   "ssl_protocols TLSv1.2 TLSv1.3;", "Strict-Transport-Security", "location / {",
                   "location = /metrics {", "deny all;"]:
        assert needle in code, needle
    assert re.search(r"upstream dilocod \{\s*server 127\.0\.0\.1:8470;", code)
    assert re.search(r"\bkeepalive \d+;", code)
    body = re.search(r"client_max_body_size (\d+)g;", code)
    assert body and int(body.group(1)) >= 16, "client_max_body_size must hold a multi-GB delta"
    for t in ("proxy_read_timeout", "proxy_send_timeout", "client_body_timeout"):
        m = re.search(rf"{t} (\d+)s;", code)
        assert m and int(m.group(1)) >= 300, t
    assert "TLSv1 " not in code and "TLSv1.1" not in code and "SSLv3" not in code


def nginx_site(tmp: Path, upstream_port: int, tls_port: int, http_port: int) -> Path:
    """deploy/nginx-tls.conf with the site-specific parts replaced: the upstream port, the listen
    addresses (loopback, free ports; IPv6 listeners dropped) and the certificate paths. Each
    replacement must match exactly as often as expected, so a changed file fails loudly."""
    text = (DEPLOY / "nginx-tls.conf").read_text()
    subs = [
        (r"server 127\.0\.0\.1:8470;", f"server 127.0.0.1:{upstream_port};", 1),
        (r"listen 443 ssl;", f"listen 127.0.0.1:{tls_port} ssl;", 1),
        (r"listen 80;", f"listen 127.0.0.1:{http_port};", 1),
        (r"listen \[::\]:(443 ssl|80);", "", 2),
        (r"ssl_certificate\s+\S+;", f"ssl_certificate {tmp}/cert.pem;", 1),
        (r"ssl_certificate_key\s+\S+;", f"ssl_certificate_key {tmp}/key.pem;", 1),
    ]
    for pattern, repl, count in subs:
        text, n = re.subn(pattern, repl, text)
        assert n == count, (pattern, n)
    site = tmp / "site.conf"
    site.write_text(text)
    user = "user root;\n" if os.geteuid() == 0 else ""
    (tmp / "nginx.conf").write_text(f"""
daemon off;
{user}worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy_temp;
    fastcgi_temp_path {tmp}/fastcgi_temp;
    uwsgi_temp_path {tmp}/uwsgi_temp;
    scgi_temp_path {tmp}/scgi_temp;
    include {site};
}}
""")
    return tmp / "nginx.conf"


def self_signed(tmp: Path):
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", tmp / "key.pem", "-out", tmp / "cert.pem"], check=0)


def nginx_test(conf: Path) -> str:
    tmp = conf.parent
    p = run(["nginx", "-t", "-p", tmp, "-c", conf, "-e", tmp / "error.log"])
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "test is successful" in out, out
    assert "[warn]" not in out and "[emerg]" not in out, out
    return out


def curl(*args):
    """curl -k with the status code (and nothing else) on the last line of stdout."""
    p = run(["curl", "-sS", "-k", "--max-time", "60", "-w", "\n%{http_code}", *args])
    assert p.returncode == 0, p.stderr
    body, _, status = p.stdout.rpartition("\n")
    return int(status), body


def test_nginx_conf_passes_nginx_t(tmp_path):
    self_signed(tmp_path)
    nginx_test(nginx_site(tmp_path, 8470, free_port(), free_port()))


@pytest.fixture
def tls_stack(tmp_path):
    """dilocod (hub none, one node, a token file, a 10 MiB F32 model) behind the real nginx with
    deploy/nginx-tls.conf. Yields (dilocod, https base URL, http base URL, nginx prefix dir)."""
    model = tmp_path / "init.safetensors"
    write_model(model, {"w": torch.zeros(NPARAMS)})
    tokens = tmp_path / "tokens"
    tokens.write_text(f"node-a {TOKEN}\n")
    tokens.chmod(0o600)         # dilocod refuses a token file others can read
    d = Dilocod(tmp_path, None, "--init-model", model, "--nodes", "node-a", "--token-file", tokens).start()
    ngx = tmp_path / "nginx"
    ngx.mkdir()
    self_signed(ngx)
    tls_port, http_port = free_port(), free_port()
    conf = nginx_site(ngx, d.port, tls_port, http_port)
    nginx_test(conf)
    proc = subprocess.Popen(["nginx", "-p", ngx, "-c", conf, "-e", ngx / "error.log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", tls_port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.time() < deadline, "nginx did not start listening"
                time.sleep(0.05)
        yield d, f"https://127.0.0.1:{tls_port}", f"http://127.0.0.1:{http_port}", ngx
    finally:
        proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        d.stop()


def test_nginx_tls_proxy_end_to_end(tls_stack, tmp_path):
    d, https, http, ngx = tls_stack

    # status through TLS, with HSTS added by the proxy
    p = run(["curl", "-sS", "-k", "-D", "-", "-o", tmp_path / "status.json", f"{https}/status"], check=0)
    assert re.search(r"^HTTP/1\.1 200", p.stdout, re.M), p.stdout
    assert re.search(r"(?im)^strict-transport-security: max-age=\d+", p.stdout), p.stdout
    assert '"outer_step":0' in (tmp_path / "status.json").read_text()

    # plain HTTP redirects to HTTPS
    status, _ = curl("-o", "/dev/null", f"{http}/status")
    assert status == 301

    # a 10 MiB delta streams through the proxy: 201, and the round (one node) closes
    delta = tmp_path / "delta_1.safetensors"
    delta.write_bytes(np_save({"w": np.full(NPARAMS, 0.01, np.float32)}, metadata=delta_metadata("node-a", 0, 1)))
    assert delta.stat().st_size > 10 << 20
    status, body = curl("-T", delta, "-H", f"Authorization: Bearer {TOKEN}",
                        f"{https}/nodes/node-a/delta_1.safetensors")
    assert status == 201, body
    assert '"result":"accepted"' in body and f'"bytes":{delta.stat().st_size}' in body, body
    # streamed: nginx neither spooled the body to a temporary file nor warned about it
    assert "buffered to a temporary file" not in (ngx / "error.log").read_text()
    assert not (ngx / "client_body").exists() or not any((ngx / "client_body").rglob("*"))

    # the aggregated global comes back through the proxy, identical to what dilocod serves directly
    deadline = time.time() + 30
    while d.committed_step() != 1:
        assert time.time() < deadline, d.log_text()[-3000:]
        time.sleep(0.05)
    got = tmp_path / "global.safetensors"
    p = run(["curl", "-sS", "-k", "-D", "-", "-o", got, f"{https}/global/latest.safetensors"], check=0)
    assert re.search(r"(?im)^x-outer-step: 1\r?$", p.stdout), p.stdout
    want = subprocess.run(["curl", "-sS", f"{d.url}/global/latest.safetensors"], capture_output=True, timeout=60)
    assert want.returncode == 0
    assert hashlib.sha256(got.read_bytes()).digest() == hashlib.sha256(want.stdout).digest()
    status, body = curl("-r", "0-99", "-o", tmp_path / "part", f"{https}/global/latest.safetensors")
    assert status == 206 and (tmp_path / "part").read_bytes() == want.stdout[:100]

    # refusals with a small body come through as dilocod's own answers
    small = tmp_path / "small.bin"
    small.write_bytes(delta.read_bytes()[:4000])
    status, body = curl("-T", small, f"{https}/nodes/node-a/delta_2.safetensors")
    assert status == 401 and '"unauthorized"' in body, (status, body)

    # /metrics is allowed from this host (the allow list includes loopback)
    status, body = curl(f"{https}/metrics")
    assert status == 200 and "dilocod_outer_step 1" in body, body


def test_nginx_large_refused_upload_gets_dilocods_answer(tls_stack, tmp_path):
    """A multi-MiB upload that dilocod refuses from its first bytes must reach the client as dilocod's
    answer (401 bad token, 422 wrong shape), not as a 502 from the proxy: diloco push retries a 5xx,
    sending the whole delta again, and finally reports a network error instead of the refusal."""
    d, https, http, ngx = tls_stack
    good = tmp_path / "good.safetensors"
    good.write_bytes(np_save({"w": np.full(NPARAMS, 0.01, np.float32)}, metadata=delta_metadata("node-a", 0, 1)))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(np_save({"w": np.full((NPARAMS // 2, 2), 0.01, np.float32)},
                            metadata=delta_metadata("node-a", 0, 1)))
    url = f"{https}/nodes/node-a/delta_1.safetensors"
    got = []
    for _ in range(10):
        got.append(("no token", 401, curl("-o", "/dev/null", "-T", good, url)[0]))
        got.append(("wrong token", 401, curl("-o", "/dev/null", "-T", good, "-H",
                                             "Authorization: Bearer token-bbbbbbbbbbbbbbbbbbbb", url)[0]))
        got.append(("wrong shape", 422, curl("-o", "/dev/null", "-T", bad, "-H", f"Authorization: Bearer {TOKEN}",
                                             url)[0]))
    wrong = [g for g in got if g[1] != g[2]]
    assert not wrong, f"{len(wrong)} of {len(got)} refusals arrived wrong: {wrong}"
