"""A wrong Hub token or repo id, end to end: dilocod against the Hub emulator (tests/hubsim/hubsim.py).

What the operator must get (issue 13): one clear log line naming the problem and the fix (HF_TOKEN,
--hub-token-file, hub_token_file, the repo id in --hub hf://<namespace>/<repo>), not one line per poll;
polls that slow down instead of hammering the Hub; the problem in /status; one line again when it is
fixed, and one when it comes back.

The emulator must answer as the real Hub does, which the stock huggingface_hub client tells apart:
no token on a private repo is 401 + X-Error-Code RepoNotFound (RepositoryNotFoundError); a wrong token
is 401 + X-Error-Message "Invalid credentials in Authorization header" with no error code (a plain
HfHubHTTPError: huggingface_hub's hf_raise_for_status checks that message so that a bad token is not
reported as a missing repo)."""
import os

os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import pytest  # noqa: E402
from huggingface_hub import HfApi, hf_hub_download  # noqa: E402
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError  # noqa: E402

from dilocod_proc import write_model  # noqa: E402
from test_daemon_hf import REPO, TOKEN, HfDilocod, HubSim, by_dilocod, model, procs  # noqa: E402,F401

WRONG = "hf_wrongTokenForTheTest_0123456789"
REFUSED = "the Hub refuses access: the token or the repo id is wrong"
RESTORED = "the Hub accepts the token again"


def revision_polls(hub, status):
    """dilocod's revision requests answered with status, oldest first."""
    return [e for e in hub.requests()
            if by_dilocod(e) and e["path"].startswith(f"/api/models/{REPO}/revision/") and e["status"] == status]


def test_hubsim_answers_a_missing_or_wrong_token_as_the_hub_does(tmp_path, procs):
    hub = HubSim(tmp_path)
    procs.append(hub)
    HfApi(endpoint=hub.wendpoint, token=TOKEN).create_repo(REPO)
    HfApi(endpoint=hub.wendpoint, token=TOKEN).upload_file(path_or_fileobj=b"{}", path_in_repo="a.json",
                                                           repo_id=REPO)

    with pytest.raises(RepositoryNotFoundError) as e:
        HfApi(endpoint=hub.wendpoint, token=False).repo_info(REPO)
    assert e.value.response.status_code == 401
    assert e.value.response.headers["X-Error-Code"] == "RepoNotFound"

    for call in (lambda: HfApi(endpoint=hub.wendpoint, token=WRONG).repo_info(REPO),
                 lambda: hf_hub_download(REPO, "a.json", endpoint=hub.wendpoint, token=WRONG,
                                         cache_dir=str(tmp_path / "cache"))):
        with pytest.raises(HfHubHTTPError) as e:
            call()
        assert not isinstance(e.value, RepositoryNotFoundError), type(e.value)
        assert e.value.response.status_code == 401
        assert "X-Error-Code" not in e.value.response.headers
        assert e.value.response.headers["X-Error-Message"] == "Invalid credentials in Authorization header"
        assert "Invalid credentials in Authorization header" in str(e.value)


def test_wrong_token_is_said_once_polls_back_off_and_recovery_is_said(tmp_path, procs):
    hub = HubSim(tmp_path)
    procs.append(hub)
    HfApi(endpoint=hub.wendpoint, token=TOKEN).create_repo(REPO)
    token_file = tmp_path / "hub-token"
    token_file.write_text(WRONG + "\n")
    d = HfDilocod(tmp_path, hub, "--nodes", "w0,w1", token_file=token_file)
    procs.append(d)
    d.start()

    # five refused polls: the pace slows (each wait longer than the one before), one log line
    refused = d.wait(lambda: (lambda r: r if len(r) >= 5 else None)(revision_polls(hub, 401)), "5 refused polls")
    gaps = [b["time"] - a["time"] for a, b in zip(refused, refused[1:])]
    assert all(later > earlier for earlier, later in zip(gaps, gaps[1:])), gaps
    log = d.log_text()
    assert log.count(REFUSED) == 1, log
    line = next(ln for ln in log.splitlines() if REFUSED in ln)
    for words in ("problem=unauthorized", "status=401", "route=revision", "repo=org/model", "token=set",
                  '"Invalid credentials in Authorization header"', "HF_TOKEN", "--hub-token-file",
                  "hub_token_file", "--hub hf://<namespace>/<repo>", 'retry="polls back off up to 60 s"'):
        assert words in line, (words, line)
    assert "revision: HTTP 401" not in log and "hub request failed" not in log, log
    assert WRONG not in log

    status = d.status()
    assert status["hub"]["last_transport_error"] == (
        "unauthorized: HTTP 401 on revision (Invalid credentials in Authorization header): "
        "the Hub token or the repo id hf://org/model is wrong")
    assert status["hub"]["transport_errors"] >= 5
    assert status["hub"]["problem"] == "unauthorized"
    import requests
    metrics = requests.get(f"http://127.0.0.1:{d.port}/metrics", timeout=10).text
    assert 'dilocod_hub_problem{problem="unauthorized"} 1' in metrics

    # the token becomes valid (as if the operator fixed it on the Hub): said once, /status clears
    hub.ctl("POST", "/_sim/config", {"tokens": [TOKEN, WRONG]})
    d.wait_log(RESTORED)
    d.wait(lambda: revision_polls(hub, 200), "an accepted poll")
    assert "was=unauthorized" in next(ln for ln in d.log_text().splitlines() if RESTORED in ln)
    assert d.status()["hub"]["last_transport_error"] is None
    assert d.status()["hub"]["problem"] is None

    # ... and invalid again: the new episode is said once more
    hub.ctl("POST", "/_sim/config", {"tokens": [TOKEN]})
    d.wait_log(REFUSED, count=2)
    before = len(revision_polls(hub, 401))
    d.wait(lambda: len(revision_polls(hub, 401)) >= before + 2, "two more refused polls")
    assert d.log_text().count(REFUSED) == 2
    assert d.log_text().count(RESTORED) == 1
    assert d.stop() == 0


def test_wrong_repo_id_is_named_until_the_repo_exists(tmp_path, procs):
    hub = HubSim(tmp_path)
    procs.append(hub)
    d = HfDilocod(tmp_path, hub, "--nodes", "w0,w1")    # the valid token, but org/model does not exist
    procs.append(d)
    d.start()
    d.wait(lambda: len(revision_polls(hub, 404)) >= 3, "3 polls of a missing repo")
    log = d.log_text()
    assert log.count(REFUSED) == 1, log
    line = next(ln for ln in log.splitlines() if REFUSED in ln)
    assert "problem=repo_not_found status=404 code=RepoNotFound" in line, line
    assert "--hub hf://<namespace>/<repo>" in line, line
    assert d.status()["hub"]["last_transport_error"].startswith(
        "repo_not_found: HTTP 404 RepoNotFound on revision (Repository not found: org/model)")

    HfApi(endpoint=hub.wendpoint, token=TOKEN).create_repo(REPO)
    d.wait_log(RESTORED)
    assert "was=repo_not_found" in next(ln for ln in d.log_text().splitlines() if RESTORED in ln)
    d.wait(lambda: revision_polls(hub, 200), "an accepted poll")
    assert d.status()["hub"]["last_transport_error"] is None
    assert d.log_text().count(REFUSED) == 1
    assert d.stop() == 0


def test_read_only_token_is_said_once_while_polls_go_on(tmp_path, procs):
    """The Hub lets the token read but refuses its writes (403 on the publish's preupload, as for a
    read-only token): said once with the fix, polls stay at their pace (deltas still come in) and do
    not count as the problem being over; when the writes go through, that is said once."""
    hub = HubSim(tmp_path)
    procs.append(hub)
    HfApi(endpoint=hub.wendpoint, token=TOKEN).create_repo(REPO)
    hub.fault(status=403, method="POST", route="preupload", count=-1, message="This token has read access only")
    init = tmp_path / "init.safetensors"
    write_model(init, model())
    d = HfDilocod(tmp_path, hub, "--init-model", init, "--nodes", "w0,w1", "--retry-interval", "0.3")
    procs.append(d)
    d.start()

    def refused_writes():
        return [e for e in hub.requests() if by_dilocod(e) and e["route"] == "preupload" and e["status"] == 403]
    d.wait(lambda: len(refused_writes()) >= 3, "3 refused publish attempts")
    first = refused_writes()[0]["seq"]
    d.wait(lambda: len([e for e in revision_polls(hub, 200) if e["seq"] > first]) >= 3, "3 polls after it")
    log = d.log_text()
    assert log.count(REFUSED) == 1, log
    assert RESTORED not in log, log
    line = next(ln for ln in log.splitlines() if REFUSED in ln)
    for words in ("problem=forbidden status=403 code=Forbidden route=preupload", "write access",
                  '"This token has read access only"', 'retry="publishing is retried"'):
        assert words in line, (words, line)
    assert d.status()["hub"]["last_transport_error"] == (
        "forbidden: HTTP 403 Forbidden on preupload (This token has read access only): "
        "the Hub token or the repo id hf://org/model is wrong")

    hub.clear_faults()
    d.wait_published(0)
    assert d.log_text().count(RESTORED) == 1
    assert "was=forbidden" in next(ln for ln in d.log_text().splitlines() if RESTORED in ln)
    assert d.status()["hub"]["last_transport_error"] is None
    assert d.log_text().count(REFUSED) == 1
    assert d.stop() == 0


@pytest.mark.parametrize("case", ["revision_not_found", "gated"])
def test_missing_revision_or_gated_repo_is_named(tmp_path, procs, case):
    """--hub hf://org/model@<a branch that does not exist> (the emulator's real 404 RevisionNotFound),
    and a gated repo (403 with X-Error-Code GatedRepo, which huggingface_hub raises as GatedRepoError):
    each named once, with its own fix."""
    hub = HubSim(tmp_path)
    procs.append(hub)
    HfApi(endpoint=hub.wendpoint, token=TOKEN).create_repo(REPO)
    if case == "gated":
        hub.fault(status=403, route="repo_info", count=-1, error_code="GatedRepo",
                  message="Access to model org/model is restricted. You must have access to it.")
    d = HfDilocod(tmp_path, hub, "--nodes", "w0,w1")
    procs.append(d)
    d.start(*(["--hub", f"hf://{REPO}@no-such-branch"] if case == "revision_not_found" else []))
    d.wait(lambda: len([e for e in hub.requests() if by_dilocod(e) and e["route"] == "repo_info"]) >= 3,
           "3 refused polls")
    log = d.log_text()
    assert log.count(REFUSED) == 1, log
    line = next(ln for ln in log.splitlines() if REFUSED in ln)
    if case == "gated":
        assert "problem=gated status=403 code=GatedRepo" in line and "accept its conditions" in line, line
        with pytest.raises(GatedRepoError):    # the stock client's reading of the same answer
            HfApi(endpoint=hub.wendpoint, token=TOKEN).repo_info(REPO)
    else:
        assert "problem=revision_not_found status=404 code=RevisionNotFound" in line, line
        assert "hf://<namespace>/<repo>@<revision>" in line, line
    assert d.status()["hub"]["last_transport_error"].startswith(f"{case}: HTTP ")
    assert d.stop() == 0


def test_json_log_of_the_problem_keeps_every_value_a_string(tmp_path, procs):
    """--log-format json: one object per line; the repo id, the Hub's words and the fix stay strings
    (a repo named with digits is not turned into a number), the HTTP status is a number."""
    import json

    hub = HubSim(tmp_path)
    procs.append(hub)
    d = HfDilocod(tmp_path, hub, "--nodes", "w0,w1", "--log-format", "json")
    procs.append(d)
    d.start("--hub", "hf://4242/7")
    d.wait(lambda: REFUSED in d.log_text(), "the refusal logged")
    events = [json.loads(ln) for ln in d.log_text().splitlines() if ln.strip()]
    (ev,) = [e for e in events if e["msg"] == REFUSED]
    assert ev["level"] == "error" and ev["component"] == "hub", ev
    assert ev["problem"] == "repo_not_found" and ev["status"] == 404 and ev["code"] == "RepoNotFound", ev
    assert ev["repo"] == "4242/7" and ev["route"] == "revision", ev
    assert ev["hub_says"] == "Repository not found: 4242/7", ev
    assert "HF_TOKEN" in ev["fix"] and ev["retry"] == "polls back off up to 60 s", ev
    assert d.stop() == 0
