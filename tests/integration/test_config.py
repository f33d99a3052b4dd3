"""dilocod's configuration: the config file syntax (quoted values, inline comments), --check-config
checking what a start checks (the init model, the token file, the listen address, the state and hub
paths) with the option name and FILE:LINE, the printed configuration read back as a config file, and a
failed start leaving nothing on disk.  Runs the real dilocod; model files are written with the
safetensors package."""
import json
import os
import re
import socket
import subprocess
import time

import numpy as np
import pytest
import requests
from safetensors.numpy import save_file

from conftest import BUILD, ROOT, run
from dilocod_proc import Dilocod

TOKEN = "0123456789abcdef0123"


def dilocod(*args, env=None, check=None):
    return run([BUILD / "dilocod", *args], check=check, env=dict(os.environ, **(env or {})))


def model(path):
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, dtype=np.float32)}, str(path))
    return path


def settings(printed):
    """The key = value lines of a printed configuration (comments dropped)."""
    return [ln for ln in printed.splitlines() if ln and not ln.startswith("#")]


def assert_fails(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert p.stdout == "", p.stdout
    for n in needles:
        assert re.search(n, p.stderr), (n, p.stderr)


# ---- the printed configuration is a config file --------------------------------------------------

ROUND_TRIPS = [
    ["--expected-nodes", "2"],
    ["--nodes", "w1,w2,w3", "--optimizer", "sgd", "--lr", "0.1", "--round-timeout", "2.5", "--min-nodes", "2",
     "--log-format", "json", "--log-level", "debug", "--listen", "none", "--threads", "3"],
    ["--round-timeout", "30", "--hub", "hf://org/model@main", "--hub-endpoint", "http://127.0.0.1:9"],
    ["--expected-nodes", "2", "--listen", "[::1]:0", "--max-body-mib", "7", "--header-timeout", "0.25"],
    ["--mode", "async", "--max-staleness", "4", "--staleness-weight", "poly", "--dn-period", "3", "--dn-variant",
     "paper", "--dn-momentum-activation", "0.25", "--grace-ms", "250", "--async-queue", "9", "--dylu-base-steps",
     "64", "--publish-interval", "2.5"],
    ["--mode", "async", "--hub", "hf://org/model", "--hub-endpoint", "http://127.0.0.1:9"],
    ["--expected-nodes", "5", "--aggregate", "trimmed_mean:2", "--max-norm-ratio", "8.5", "--max-norm", "1e6",
     "--screen", "cosine:-0.25"],
    ["--expected-nodes", "3", "--aggregate", "clipped_mean"],
    ["--expected-nodes", "3", "--aggregate", "weighted_mean", "--max-weight-ratio", "2.5"],
]


@pytest.mark.parametrize("args", ROUND_TRIPS, ids=range(len(ROUND_TRIPS)))
def test_printed_configuration_reads_back(tmp_path, args):
    """--check-config's output fed back through --check-config --config gives the same settings."""
    odd = tmp_path / "state dir #1"                     # a blank and a '#': printed quoted
    p = dilocod("--state-root", odd, "--init-model", model(tmp_path / "init.safetensors"),
                "--token-file", tokens(tmp_path), *args, "--check-config", env={"HF_TOKEN": "hf_secret_for_test"},
                check=0)
    first = p.stdout
    assert not re.search(r"^\w+ =\s*$", first, re.M), f"an empty value does not read back:\n{first}"
    assert "hf_secret_for_test" not in first, first
    assert re.search(r'^state_root = "' + re.escape(str(odd)) + '"$', first, re.M), first
    conf = tmp_path / "printed.conf"
    conf.write_text(first)
    p = dilocod("--config", conf, "--check-config", env={"HF_TOKEN": "hf_secret_for_test"}, check=0)
    assert settings(p.stdout) == settings(first), (first, p.stdout)
    assert f"# read from {conf}" in p.stdout


def test_unset_options_print_as_comments(tmp_path):
    out = dilocod("--expected-nodes", "2", "--check-config", check=0).stdout
    for key in ("init_model", "token_file", "nodes", "hub_endpoint", "hub_token_file"):
        assert re.search(rf"^# {key}: not set", out, re.M), (key, out)
        assert not re.search(rf"^{key} =", out, re.M), (key, out)
    # shortest exact decimals, not 0.69999999999999996
    assert re.search(r"^lr = 0\.7$", out, re.M) and re.search(r"^momentum = 0\.9$", out, re.M), out


def test_shipped_config_file_reads_back(tmp_path):
    p = dilocod("--config", ROOT / "config/dilocod.conf", "--expected-nodes", "2", "--state-root",
                tmp_path / "s", "--check-config", check=0)
    conf = tmp_path / "again.conf"
    conf.write_text(p.stdout)
    q = dilocod("--config", conf, "--check-config", check=0)
    assert settings(q.stdout) == settings(p.stdout)


# ---- syntax ---------------------------------------------------------------------------------------

def test_quoted_values_and_inline_comments(tmp_path):
    hub = tmp_path / "hub #a"
    conf = tmp_path / "d.conf"
    conf.write_text(
        'listen = "127.0.0.1:0"          # the API, quoted\n'
        "expected_nodes = 3 # three workers\n"
        "id = 'agg-1'\t# single quotes: verbatim\n"
        f'hub = "file://{hub}"\n'
        "lr = 0.5 #a comment after a blank\n"
        f'init_model = "{tmp_path}/in\\"it.safetensors"\n'
        "nodes = a, b ,c   # blanks around ids are dropped\n")
    model(tmp_path / 'in"it.safetensors')
    p = dilocod("--config", conf, "--state-root", tmp_path / "s", "--check-config", check=0)
    out = p.stdout
    assert re.search(r"^listen = 127\.0\.0\.1:0$", out, re.M), out
    assert re.search(r"^expected_nodes = 3$", out, re.M), out
    assert re.search(r"^id = agg-1$", out, re.M), out
    assert re.search(r"^lr = 0\.5$", out, re.M), out
    assert re.search(r"^nodes = a,b,c$", out, re.M), out
    assert re.search(r'^hub = "file://' + re.escape(str(hub)) + '"$', out, re.M), out
    assert re.search(r'^init_model = ' + re.escape(f"{tmp_path}/in\"it.safetensors") + "$", out, re.M), out


def test_hash_inside_a_bare_value_is_kept(tmp_path):
    conf = tmp_path / "d.conf"
    conf.write_text(f"expected_nodes = 2\nstate_root = {tmp_path}/a#b  # but this is a comment\n")
    out = dilocod("--config", conf, "--check-config", check=0).stdout
    assert re.search(r"^state_root = " + re.escape(f"{tmp_path}/a#b") + "$", out, re.M), out


def test_quoted_listen_serves_there(tmp_path):
    """The issue's example: a quoted listen value is the address dilocod really listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "d.conf"
    conf.write_text(f'listen = "127.0.0.1:{port}"   # quoted, with a comment\nexpected_nodes = 2\n')
    log = tmp_path / "dilocod.log"
    proc = subprocess.Popen([str(BUILD / "dilocod"), "--config", str(conf), "--state-root", str(tmp_path / "s"),
                             "--init-model", str(model(tmp_path / "init.safetensors"))],
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    try:
        deadline = time.time() + 60
        while f"port={port}" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.05)
        r = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, log.read_text()


@pytest.mark.parametrize("line, needle", [
    ('listen = "127.0.0.1:8470\n', "no closing quote"),
    ("listen = '127.0.0.1:8470\n", "no closing quote"),
    ('listen = "127.0.0.1:8470" 8471\n', "text after the closing quote"),
    ('state_root = "/tmp/a\\qb"\n', "unknown escape"),
    ("listen = 127.0.0.1:99999\n", "port must be"),
    ('min_nodes = "x"\n', "not an integer"),
    ("mode = asynchronous\n", "not a mode"),
    ("max_staleness = -1\n", "not an integer"),
    ("staleness_weight = linear\n", "not a staleness weight"),
    ("dn_variant = adam\n", "not a Delayed Nesterov variant"),
])
def test_syntax_errors_name_file_line_and_option(tmp_path, line, needle):
    conf = tmp_path / "d.conf"
    conf.write_text("# a comment line\nexpected_nodes = 2\n" + line)
    key = line.split("=")[0].strip()
    assert_fails(dilocod("--config", conf, "--check-config"), re.escape(f"{conf}:3: {key}:"), needle)


def test_async_options_checked_and_defaulted(tmp_path):
    """Async mode's values are checked together (c at most 1/N, for the paper variant only), its defaults
    derived from the round size, and hf:// publishes at most every 30 s in async mode unless told."""
    assert_fails(dilocod("--expected-nodes", "4", "--mode", "async", "--dn-variant", "paper",
                         "--dn-momentum-activation", "0.5", "--check-config"), "dn-momentum-activation", "above 1/N")
    assert_fails(dilocod("--expected-nodes", "4", "--mode", "async", "--dn-momentum-activation", "0.1",
                         "--check-config"), "dn-momentum-activation", "paper")
    out = dilocod("--expected-nodes", "4", "--mode", "async", "--hub", "hf://org/model", "--hub-endpoint",
                  "http://127.0.0.1:9", "--check-config", check=None).stdout
    conf = dict(line.split(" = ", 1) for line in out.splitlines() if " = " in line and not line.startswith("#"))
    assert conf["mode"] == "async" and conf["dn_period"] == "4" and conf["async_queue"] == "16", conf
    assert conf["publish_interval"] == "30" and conf["max_staleness"] == "none", conf
    out = dilocod("--expected-nodes", "4", "--check-config", check=None).stdout
    conf = dict(line.split(" = ", 1) for line in out.splitlines() if " = " in line and not line.startswith("#"))
    assert conf["mode"] == "sync" and conf["publish_interval"] == "0", conf


def test_robust_options_checked(tmp_path):
    """--aggregate, --max-norm-ratio and --screen refuse what they cannot mean, naming the option."""
    assert_fails(dilocod("--expected-nodes", "4", "--aggregate", "krum", "--check-config"), "aggregate",
                 "not an aggregation rule")
    assert_fails(dilocod("--expected-nodes", "4", "--aggregate", "trimmed_mean", "--check-config"), "aggregate",
                 "trimmed_mean:K")
    assert_fails(dilocod("--expected-nodes", "4", "--aggregate", "trimmed_mean:2", "--check-config"), "aggregate",
                 "trims every value")
    assert_fails(dilocod("--expected-nodes", "4", "--aggregate", "median:1", "--check-config"), "aggregate",
                 "not an aggregation rule")
    assert_fails(dilocod("--expected-nodes", "4", "--max-norm-ratio", "0.5", "--check-config"), "max-norm-ratio",
                 "R >= 1")
    assert_fails(dilocod("--mode", "async", "--max-norm-ratio", "10", "--check-config"), "max-norm-ratio",
                 "needs --expected-nodes")
    assert_fails(dilocod("--expected-nodes", "4", "--screen", "cosine:2", "--check-config"), "screen", "from -1 to 1")
    assert_fails(dilocod("--expected-nodes", "4", "--screen", "norm:1", "--check-config"), "screen", "not a screen")
    out = dilocod("--expected-nodes", "4", "--check-config", check=None).stdout
    conf = dict(line.split(" = ", 1) for line in out.splitlines() if " = " in line and not line.startswith("#"))
    assert conf["aggregate"] == "mean" and conf["screen"] == "none" and conf["max_norm_ratio"] == "0", conf
    assert conf["max_weight_ratio"] == "10", conf


@pytest.mark.parametrize("value", ["0.5", "0", "-1", "nan", "inf", "1e31", "ten", ""])
def test_max_weight_ratio_refuses_what_cannot_cap(tmp_path, value):
    """--max-weight-ratio R (weighted_mean's cap, R x the round's median weight) is finite and at least 1:
    anything else exits 2 naming the option, as a flag and as FILE:LINE in a config file."""
    assert_fails(dilocod("--expected-nodes", "4", "--max-weight-ratio", value, "--check-config"),
                 "max-weight-ratio", "not a number in \\[1, 1e\\+30\\]")
    conf = tmp_path / "w.conf"
    conf.write_text(f"expected_nodes = 4\naggregate = weighted_mean\nmax_weight_ratio = '{value}'\n")
    assert_fails(dilocod("--config", conf, "--check-config"), re.escape(f"{conf}:3: max_weight_ratio"),
                 "not a number")


def test_max_weight_ratio_prints_and_reads_back(tmp_path):
    out = dilocod("--expected-nodes", "4", "--aggregate", "weighted_mean", "--max-weight-ratio", "1",
                  "--check-config", check=0).stdout
    assert re.search(r"^max_weight_ratio = 1$", out, re.M), out


def test_cluster_options_checked(tmp_path):
    """--cluster-shards refuses what a cluster cannot do, naming the option; its values print back."""
    s3 = ["--hub", "s3://bucket/run", "--hub-endpoint", "http://127.0.0.1:9", "--expected-nodes", "4"]
    env = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret"}
    assert_fails(dilocod("--expected-nodes", "4", "--cluster-shards", "4", "--check-config"), "cluster-shards",
                 "needs --hub s3://")
    assert_fails(dilocod(*s3, "--cluster-shards", "4", "--mode", "async", "--check-config", env=env),
                 "cluster-shards", "--mode sync")
    assert_fails(dilocod(*s3, "--cluster-shards", "4", "--aggregate", "clipped_mean", "--check-config", env=env),
                 "aggregate", "mean, weighted_mean, median or trimmed_mean")
    # weighted_mean's scales come from the headers every aggregator reads: a cluster takes it
    out = dilocod(*s3, "--cluster-shards", "4", "--aggregate", "weighted_mean", "--check-config", env=env,
                  check=None)
    assert out.returncode == 0, out.stderr
    assert_fails(dilocod(*s3, "--cluster-shards", "4", "--max-norm", "10", "--check-config", env=env), "max-norm",
                 "whole deltas")
    assert_fails(dilocod(*s3, "--cluster-shards", "4", "--screen", "cosine:0", "--check-config", env=env), "screen",
                 "whole deltas")
    # a cluster bootstraps an empty bucket from one file or a set's index (test_cluster_bootstrap.py)
    ok = dilocod(*s3, "--cluster-shards", "4", "--init-model", str(model(tmp_path / "m.safetensors")),
                 "--check-config", env=env, check=None)
    assert ok.returncode == 0, ok.stderr
    model(tmp_path / "s-00001-of-00001.safetensors")
    (tmp_path / "s.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 36}, "weight_map": {"b": "s-00001-of-00001.safetensors",
                                                        "w": "s-00001-of-00001.safetensors"}}))
    ok = dilocod(*s3, "--cluster-shards", "4", "--init-model", str(tmp_path / "s.safetensors.index.json"),
                 "--check-config", env=env, check=None)
    assert ok.returncode == 0, ok.stderr
    assert_fails(dilocod(*s3, "--cluster-shards", "5000", "--check-config", env=env), "cluster-shards")
    assert_fails(dilocod(*s3, "--cluster-shards", "4", "--cluster-lease", "0.5", "--check-config", env=env),
                 "cluster-lease")
    out = dilocod(*s3, "--cluster-shards", "4", "--aggregate", "median", "--cluster-lease", "7", "--check-config",
                  env=env, check=None).stdout
    conf = dict(line.split(" = ", 1) for line in out.splitlines() if " = " in line and not line.startswith("#"))
    assert conf["cluster_shards"] == "4" and conf["cluster_lease"] == "7", conf


def test_control_characters_refused(tmp_path):
    assert_fails(dilocod("--expected-nodes", "2", "--state-root", "/tmp/a\tb", "--check-config"),
                 "state-root", "control character")


def test_empty_value_unsets_an_optional_path(tmp_path):
    """A flag with an empty value cancels the file's token file; a required option may not be empty."""
    conf = tmp_path / "d.conf"
    conf.write_text(f"expected_nodes = 2\ntoken_file = {tmp_path}/missing\n")
    assert_fails(dilocod("--config", conf, "--check-config"), re.escape(f"{conf}:2: token_file:"))
    out = dilocod("--config", conf, "--token-file", "", "--check-config", check=0).stdout
    assert re.search(r"^# token_file: not set", out, re.M), out
    assert_fails(dilocod("--expected-nodes", "2", "--state-root", "", "--check-config"), "state-root",
                 "must not be empty")


# ---- what a start would refuse, --check-config refuses ---------------------------------------------

def tokens(tmp_path, text=f"w1 {TOKEN}\n* {TOKEN}x\n"):
    path = tmp_path / "tokens"
    path.write_text(text)
    path.chmod(0o600)           # dilocod refuses a token file others can read
    return path


@pytest.mark.parametrize("text, needle", [
    ("w1 short\n", "token must be 16 to 256"),
    (f"../x {TOKEN}\n", "invalid node id"),
    (f"w1 {TOKEN} extra\n", "expected 'node_id token'"),
    ("# only a comment\n", "holds no token"),
])
def test_token_file_refused_as_auth_load_refuses_it(tmp_path, text, needle):
    conf = tmp_path / "d.conf"
    conf.write_text(f"expected_nodes = 2\n\ntoken_file = {tokens(tmp_path, text)}\n")
    assert_fails(dilocod("--config", conf, "--state-root", tmp_path / "s", "--check-config"),
                 re.escape(f"{conf}:3: token_file:"), needle)
    # and the start refuses it the same way, before creating any state
    assert_fails(dilocod("--config", conf, "--state-root", tmp_path / "s", "--init-model",
                         model(tmp_path / "init.safetensors")), "token_file", needle)
    assert not (tmp_path / "s").exists()


def bad_models(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"PK\x03\x04 this is a zip archive, not safetensors" * 10)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(model(tmp_path / "whole.safetensors").read_bytes()[:-5])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return [(tmp_path / "missing.safetensors", "No such file"), (junk, "not a usable safetensors file"),
            (truncated, "metadata_incomplete_buffer"), (tmp_path, "not a regular file"),
            (fifo, "not a regular file")]


def test_init_model_must_be_a_safetensors_file(tmp_path):
    conf = tmp_path / "d.conf"
    for path, needle in bad_models(tmp_path):
        conf.write_text(f"expected_nodes = 2\ninit_model = {path}\n")
        # a FIFO would block a reader: the run's timeout fails the test if it is opened
        assert_fails(dilocod("--config", conf, "--state-root", tmp_path / "s", "--check-config"),
                     re.escape(f"{conf}:2: init_model:"), needle)
        assert_fails(dilocod("--state-root", tmp_path / "s", "--expected-nodes", "2", "--init-model", path,
                             "--check-config"), "--init-model", needle)
    assert not (tmp_path / "s").exists()
    good = dilocod("--state-root", tmp_path / "s", "--expected-nodes", "2", "--init-model",
                   model(tmp_path / "init.safetensors"), "--check-config", check=0)
    assert f"init_model = {tmp_path}/init.safetensors" in good.stdout


def test_failed_start_leaves_nothing_on_disk(tmp_path):
    """A bad init model, token file or listen address stops the start before any directory is made."""
    state, hub = tmp_path / "state", tmp_path / "hub"
    init = model(tmp_path / "init.safetensors")
    base = ["--state-root", state, "--hub", f"file://{hub}", "--expected-nodes", "2", "--listen", "127.0.0.1:0"]
    for extra, needle in [(["--init-model", tmp_path / "missing.safetensors"], "init-model"),
                          (["--init-model", init, "--token-file", tokens(tmp_path, "w1 short\n")], "token-file"),
                          (["--init-model", init, "--listen", "192.0.2.1:8470"], "not an address of this machine")]:
        assert_fails(dilocod(*base, *extra), needle)
        assert not state.exists() and not hub.exists(), extra


def test_init_model_is_not_checked_once_state_exists(tmp_path):
    """Startup ignores the init model when a step is committed; so does the check (a deleted init
    model must not stop a restart)."""
    init = model(tmp_path / "init.safetensors")
    d = Dilocod(tmp_path, None, "--init-model", init, "--expected-nodes", "2").start()
    try:
        deadline = time.time() + 60
        while not (d.state_dir / "outer_metadata.json").exists():
            assert time.time() < deadline and d.alive(), d.log_text()
            time.sleep(0.05)
    finally:
        assert d.stop() == 0
    init.unlink()
    dilocod("--state-root", d.state_root, "--expected-nodes", "2", "--init-model", init, "--check-config", check=0)
    d2 = Dilocod(tmp_path, None, "--init-model", init, "--expected-nodes", "2").start()
    try:
        assert requests.get(f"{d2.url}/healthz", timeout=10).status_code == 200
    finally:
        assert d2.stop() == 0


def test_listen_address_checked(tmp_path):
    conf = tmp_path / "d.conf"
    conf.write_text("expected_nodes = 2\nlisten = 192.0.2.1:8470\n")
    assert_fails(dilocod("--config", conf, "--check-config"), re.escape(f"{conf}:2: listen:"),
                 "not an address of this machine")
    # the port itself is not taken by the check: it passes while something listens there
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        dilocod("--expected-nodes", "2", "--listen", f"127.0.0.1:{s.getsockname()[1]}", "--check-config", check=0)


def test_state_and_hub_paths_under_a_file(tmp_path):
    f = tmp_path / "plain"
    f.write_text("x")
    assert_fails(dilocod("--expected-nodes", "2", "--state-root", f / "state", "--check-config"),
                 "--state-root", "not a directory")
    assert_fails(dilocod("--expected-nodes", "2", "--state-root", tmp_path / "s", "--hub", f"file://{f}",
                         "--check-config"), "--hub", "not a directory")
    conf = tmp_path / "d.conf"
    conf.write_text(f"expected_nodes = 2\nstate_root = {f}\n")
    assert_fails(dilocod("--config", conf, "--check-config"), re.escape(f"{conf}:2: state_root:"),
                 "not a directory")


def test_check_config_creates_nothing(tmp_path):
    dilocod("--state-root", tmp_path / "s", "--hub", f"file://{tmp_path}/hub", "--expected-nodes", "2",
            "--init-model", model(tmp_path / "init.safetensors"), "--token-file", tokens(tmp_path),
            "--check-config", check=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init.safetensors", "tokens"]


def test_flag_overrides_file_and_names_the_flag(tmp_path):
    """An error on a value a flag replaced names the flag, not the file line it overrode."""
    conf = tmp_path / "d.conf"
    conf.write_text("expected_nodes = 2\nmin_nodes = 1\n")
    p = dilocod("--config", conf, "--min-nodes", "5", "--check-config")
    assert_fails(p, "--min-nodes")
    assert f"{conf}:2" not in p.stderr, p.stderr
    conf.write_text("expected_nodes = 2\nmin_nodes = 5\n")
    assert_fails(dilocod("--config", conf, "--check-config"), re.escape(f"{conf}:2: min_nodes:"))


def test_fifo_token_file_refused_unopened(tmp_path):
    fifo = tmp_path / "tokfifo"
    os.mkfifo(fifo)
    p = subprocess.run([str(BUILD / "dilocod"), "--expected-nodes", "2", "--token-file", str(fifo),
                        "--check-config"], capture_output=True, text=True, timeout=30)
    assert_fails(p, "--token-file", "not a regular file")


def test_nothing_to_start_from_is_noted(tmp_path):
    """hub none, no init model, no committed state: valid as a file (a backup may be restored into the
    state root), but --check-config says that a start now would have nothing to start from."""
    p = dilocod("--expected-nodes", "2", "--state-root", tmp_path / "s", "--check-config", check=0)
    assert "nothing to start from" in p.stderr, p.stderr
    p = dilocod("--expected-nodes", "2", "--state-root", tmp_path / "s", "--init-model",
                model(tmp_path / "init.safetensors"), "--check-config", check=0)
    assert p.stderr == "", p.stderr


def test_non_root_start_says_what_to_do(tmp_path):
    """A user's first start without --state-root (the default /var/lib/dilocod is the service user's) says
    which option to give, and never claims to have removed a directory it did not make."""
    assert os.geteuid() == 0, "the test runs dilocod as nobody, which needs root (make check runs as root)"
    import shutil
    import tempfile
    bindir = tempfile.mkdtemp(prefix="dilocod-nobody-")
    try:
        os.chmod(bindir, 0o755)
        binary = os.path.join(bindir, "dilocod")
        shutil.copy2(BUILD / "dilocod", binary)
        os.chmod(binary, 0o755)

        def as_nobody():
            os.setgid(65534)
            os.setuid(65534)
        p = subprocess.run([binary, "--expected-nodes", "2", "--listen", "127.0.0.1:0"], cwd=bindir,
                           capture_output=True, text=True, timeout=30, preexec_fn=as_nobody,
                           env={"PATH": os.environ.get("PATH", "/usr/bin")})
    finally:
        shutil.rmtree(bindir, ignore_errors=True)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "Permission denied (give --state-root DIR" in p.stderr, p.stderr
    assert "removed the state directory" not in p.stderr, p.stderr


def test_options_the_mode_ignores_are_warned_about(tmp_path):
    """An option only another mode reads is accepted (the shipped file sets async options beside mode =
    sync) but said when it holds a value other than its default, flag or FILE:LINE, at the start and by
    --check-config; never when the mode reads it, nor for a default value."""
    conf = tmp_path / "d.conf"
    conf.write_text("mode = sync\nexpected_nodes = 2\ndn_period = 4\ngrace_ms = 0\n")
    p = dilocod("--config", str(conf), "--max-weight-ratio", "3", "--cluster-lease", "9", "--check-config", check=None)
    assert p.returncode == 0, p.stderr
    assert f"warning: {conf}:3: dn_period is read only with --mode async" in p.stderr, p.stderr
    assert "warning: --max-weight-ratio is read only with --aggregate weighted_mean" in p.stderr, p.stderr
    assert "warning: --cluster-lease is read only with --cluster-shards" in p.stderr, p.stderr
    assert "grace_ms" not in p.stderr, p.stderr             # its default: nothing to say
    p = dilocod("--config", str(conf), "--mode", "async", "--aggregate", "weighted_mean", "--max-weight-ratio", "3",
                "--check-config", check=None)
    assert p.returncode == 0 and "warning" not in p.stderr, p.stderr
    # the shipped file warns about nothing
    shipped = ROOT / "config" / "dilocod.conf"
    p = dilocod("--config", str(shipped), "--expected-nodes", "2", "--check-config", check=None)
    assert "warning" not in p.stderr, p.stderr
    # and a start says it too, before it runs
    p = dilocod("--expected-nodes", "2", "--dn-period", "4", "--state-root", str(tmp_path / "s"), "--listen",
                "127.0.0.1:0", check=None)       # hub none, no init_model: it exits 1 once started
    assert p.returncode == 1 and "warning: --dn-period is read only with --mode async" in p.stderr, p.stderr


def test_a_file_hub_that_does_not_exist_is_refused_unless_create_hub(tmp_path):
    """--hub file:///<missing> was created without a word, and a typo (or a share not mounted yet) became a
    round that never closes.  Now the start refuses it (exit 1, the path and the option named) and creates
    nothing; --check-config says so first; --create-hub (a 0|1 switch: alone, =1, or create_hub = 1 in the
    file) creates it, loudly; given with another transport it is warned about as ignored."""
    init = model(tmp_path / "init.safetensors")
    hub = tmp_path / "share" / "hub"
    base = ["--state-root", str(tmp_path / "s"), "--hub", f"file://{hub}", "--init-model", str(init),
            "--expected-nodes", "1", "--listen", "none"]
    p = dilocod(*base, check=None)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert f"the hub directory {hub} does not exist (--hub file://{hub})" in p.stderr, p.stderr
    assert "--create-hub" in p.stderr, p.stderr
    assert not (tmp_path / "share").exists(), "a refused start created the hub"
    p = dilocod(*base, "--check-config", check=None)
    assert p.returncode == 0, p.stderr
    assert f"# {hub} does not exist: the start refuses it (exit 1) unless create_hub = 1 (--create-hub)" in p.stdout
    assert "create_hub = 0" in settings(p.stdout)
    # the switch alone, before another flag: the start creates the tree, says so, and publishes step 0 there
    d = subprocess.Popen([str(BUILD / "dilocod"), "--create-hub", *base, "--log-level", "info"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while not (hub / "global" / "step_count.json").exists():
            assert d.poll() is None and time.time() < deadline, d.stderr.read() if d.poll() is not None else "timeout"
            time.sleep(0.05)
    finally:
        d.terminate()
        err = d.communicate(timeout=30)[1]
    assert d.returncode == 0, err
    assert f"warn  hub: created the hub directory, which did not exist (--create-hub) dir={hub}" in err, err
    assert json.loads((hub / "global" / "step_count.json").read_text())["outer_step"] == 0
    # an existing hub: nothing said; the file form and --create-hub=1 print back as create_hub = 1
    conf = tmp_path / "d.conf"
    conf.write_text("create_hub = 1\n")
    for extra in (["--config", str(conf)], ["--create-hub=1"], ["--create-hub", "1"]):
        p = dilocod(*base, *extra, "--check-config", check=None)
        assert p.returncode == 0 and "create_hub = 1" in settings(p.stdout), (extra, p.stdout, p.stderr)
        assert "does not exist" not in p.stdout and "warning" not in p.stderr, (p.stdout, p.stderr)
    # with another transport it does nothing, and says so
    p = dilocod("--hub", "none", "--expected-nodes", "1", "--create-hub", "--check-config", check=None)
    assert "warning: --create-hub is read only with --hub file://: ignored here" in p.stderr, p.stderr
    p = dilocod("--hub", "none", "--expected-nodes", "1", "--hub-endpoint", "http://127.0.0.1:9", "--check-config",
                check=None)
    assert "warning: --hub-endpoint is read only with --hub hf:// or s3://: ignored here" in p.stderr, p.stderr
    # a value that is not 0 or 1 is refused as any other
    assert_fails(dilocod(*base, "--create-hub", "2", "--check-config"), "create-hub")


# ---- what combines: one table (server/config_modes.c), README's copy, and every row both ways -------------

S3 = ["--hub", "s3://bucket/run", "--hub-endpoint", "http://127.0.0.1:9"]
S3_ENV = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret"}


def combination_rows():
    out = dilocod("--combinations", check=0).stdout
    lines = out.splitlines()
    assert lines[:2] == ["| asks for | needs | else |", "|---|---|---|"], out
    return out, [tuple(c.strip() for c in ln.strip("|").split(" | ")) for ln in lines[2:]]


def test_readme_table_of_what_combines_is_the_code_table():
    """README's "What combines" is `dilocod --combinations`, line for line."""
    out, _ = combination_rows()
    readme = (ROOT / "README.md").read_text()
    start = readme.index("| asks for | needs | else |")
    assert readme[start:start + len(out)] == out, "README's table of what combines differs from dilocod --combinations"


def test_every_row_of_what_combines_refuses_and_accepts(tmp_path):
    """For each row of the table: the configuration that asks without the need is refused (exit 2, both
    sides named), the one with the need accepted; an option another mode reads is warned about, and not
    with the mode that reads it.  A row added to the table without a case here fails this test."""
    cluster = [*S3, "--expected-nodes", "4", "--cluster-shards", "4"]
    key = tmp_path / "signing.key"
    run([BUILD / "diloco", "keygen", "-o", key], check=0)
    refused = {   # (asks, needs): (refused args, accepted args, the option blamed)
        ("--cluster-shards S", "--hub s3://..."):
            (["--expected-nodes", "4", "--cluster-shards", "4"], cluster, "cluster-shards"),
        ("--cluster-shards S", "--mode sync"): ([*cluster, "--mode", "async"], cluster, "cluster-shards"),
        ("--aggregate clipped_mean", "no --cluster-shards"):
            ([*cluster, "--aggregate", "clipped_mean"], [*S3, "--expected-nodes", "4", "--aggregate", "clipped_mean"],
             "aggregate"),
        ("--max-norm X", "no --cluster-shards"):
            ([*cluster, "--max-norm", "10"], [*S3, "--expected-nodes", "4", "--max-norm", "10"], "max-norm"),
        ("--max-norm-ratio R", "no --cluster-shards"):
            ([*cluster, "--max-norm-ratio", "10"], [*S3, "--expected-nodes", "4", "--max-norm-ratio", "10"],
             "max-norm-ratio"),
        ("--screen cosine:MIN", "no --cluster-shards"):
            ([*cluster, "--screen", "cosine:0"], [*S3, "--expected-nodes", "4", "--screen", "cosine:0"], "screen"),
        ("--max-norm-ratio R in --mode async", "--expected-nodes N (or --nodes)"):
            (["--mode", "async", "--max-norm-ratio", "10"],
             ["--mode", "async", "--max-norm-ratio", "10", "--nodes", "a,b"], "max-norm-ratio"),
        ("--dn-momentum-activation C in --mode async", "--dn-variant paper"):
            (["--expected-nodes", "4", "--mode", "async", "--dn-momentum-activation", "0.1"],
             ["--expected-nodes", "4", "--mode", "async", "--dn-momentum-activation", "0.1", "--dn-variant", "paper"],
             "dn-momentum-activation"),
        ("--mode sync", "--expected-nodes N, --nodes or --round-timeout S"):
            (["--mode", "sync"], ["--mode", "sync", "--round-timeout", "5"], "expected-nodes"),
        ("--signing-key FILE", "--hub file://..., s3://... or none"):
            (["--hub", "hf://org/repo", "--expected-nodes", "4", "--signing-key", str(key)],
             [*S3, "--expected-nodes", "4", "--signing-key", str(key)], "signing-key"),
        ("--signing-key FILE", "no --cluster-shards"):
            ([*cluster, "--signing-key", str(key)], [*S3, "--expected-nodes", "4", "--signing-key", str(key)],
             "signing-key"),
        ("--downlink E", "no --cluster-shards"):
            ([*cluster, "--downlink", "mxfp8"], ["--expected-nodes", "4", "--downlink", "mxfp8"], "downlink"),
        ("--downlink E", "--hub none or --hub file://..."):
            ([*S3, "--expected-nodes", "4", "--downlink", "mxfp4"],
             ["--expected-nodes", "4", "--hub", "none", "--downlink", "mxfp4"], "downlink"),
        ("--downlink E", "--publish-interval 0"):
            (["--expected-nodes", "4", "--downlink", "mxfp8", "--publish-interval", "5"],
             ["--expected-nodes", "4", "--downlink", "mxfp8", "--publish-interval", "0"], "downlink"),
    }
    ignored = {   # (flag, needs): (a value other than the default, the configuration that reads it)
        ("--max-staleness", "--mode async"): (["--max-staleness", "3"], ["--mode", "async"]),
        ("--staleness-weight", "--mode async"): (["--staleness-weight", "poly"], ["--mode", "async"]),
        ("--dn-period", "--mode async"): (["--dn-period", "3"], ["--mode", "async"]),
        ("--dn-variant", "--mode async"): (["--dn-variant", "paper"], ["--mode", "async"]),
        ("--dn-momentum-activation", "--mode async"):
            (["--dn-momentum-activation", "0.1"], ["--mode", "async", "--dn-variant", "paper"]),
        ("--grace-ms", "--mode async"): (["--grace-ms", "7"], ["--mode", "async"]),
        ("--async-queue", "--mode async"): (["--async-queue", "9"], ["--mode", "async"]),
        ("--dylu-base-steps", "--mode async"): (["--dylu-base-steps", "9"], ["--mode", "async"]),
        ("--cluster-lease", "--cluster-shards S"): (["--cluster-lease", "9"], [*S3, "--cluster-shards", "2"]),
        ("--max-weight-ratio", "--aggregate weighted_mean"):
            (["--max-weight-ratio", "3"], ["--aggregate", "weighted_mean"]),
        ("--updates-keep", "--downlink mxfp8 or mxfp4"): (["--updates-keep", "5"], ["--downlink", "mxfp8"]),
    }
    _, rows = combination_rows()
    table_refused = {(a.strip("`"), n.replace("`", "")) for a, n, e in rows if e.startswith("refused: ")}
    table_ignored = {(a.split("`")[1], n.strip("`")) for a, n, e in rows if e == "ignored, with a warning"}
    assert table_refused == set(refused), (table_refused ^ set(refused))
    assert table_ignored == set(ignored), (table_ignored ^ set(ignored))
    for (asks, needs), (bad, good, key) in refused.items():
        p = dilocod(*bad, "--check-config", env=S3_ENV, check=None)
        assert p.returncode == 2, (asks, needs, p.stderr)
        side = needs[3:] if needs.startswith("no ") else needs
        assert f"dilocod: --{key}: {asks} " in p.stderr and side in p.stderr, (asks, needs, p.stderr)
        p = dilocod(*good, "--check-config", env=S3_ENV, check=None)
        assert p.returncode == 0, (asks, needs, p.stderr)
    for (flag, needs), (value, reads) in ignored.items():
        p = dilocod("--expected-nodes", "4", *value, "--check-config", env=S3_ENV, check=None)
        assert p.returncode == 0 and f"warning: {flag} is read only with {needs}: ignored here" in p.stderr, \
            (flag, p.stderr)
        p = dilocod("--expected-nodes", "4", *reads, *value, "--check-config", env=S3_ENV, check=None)
        assert p.returncode == 0 and "warning" not in p.stderr, (flag, reads, p.stderr)
