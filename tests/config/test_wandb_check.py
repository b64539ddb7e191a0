"""logger=wandb's up-front checks (quest.config.wandb_check): whether an online run has credentials, answered without a
prompt, a write or a connection. wandb's own resolution (what wandb.init calls before it prompts) is the reference
for the fallback that reads the environment and the netrc file itself; both are asked about the same homes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from quest.config import wandb_check
from quest.config.checks import Checks, ConfigError

KEY = "k" * 40  # the form wandb accepts; never sent anywhere here


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A user's home with no wandb credentials in it or in the environment; wandb's settings read afresh."""
    from wandb.sdk import wandb_setup

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setattr(wandb_setup, "_singleton", None, raising=False)  # wandb 0.20 on caches its settings there
    return home


def netrc_entry(home: Path, machine: str) -> None:
    path = home / ".netrc"
    path.write_text(f"machine {machine}\n  login user\n  password {KEY}\n")
    path.chmod(0o600)  # Python's netrc refuses a file others can read


# (environment, netrc machine or None, whether credentials are found)
HOMES = {
    "nothing": ({}, None, False),
    "api_key": ({"WANDB_API_KEY": KEY}, None, True),
    "identity_token_file": ({"WANDB_IDENTITY_TOKEN_FILE": "/nonexistent/token"}, None, True),
    "netrc_wandb_ai": ({}, "api.wandb.ai", True),  # what `wandb login` wrote before wandb's default moved to Forge
    "netrc_other_host": ({}, "example.org", False),
    "own_server": ({"WANDB_BASE_URL": "https://wandb.example.org"}, "wandb.example.org", True),
    "own_server_netrc_elsewhere": ({"WANDB_BASE_URL": "https://wandb.example.org"}, "api.wandb.ai", False),
}


@pytest.mark.parametrize("case", HOMES)
def test_credentials_as_wandb_finds_them(case, home, monkeypatch):
    env, machine, found = HOMES[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if machine is not None:
        netrc_entry(home, machine)
    before = sorted(p.name for p in home.rglob("*"))
    assert (wandb_check.wandb_credentials() is not None) == found  # wandb's own resolution
    assert (wandb_check._read_credentials() is not None) == found  # the fallback agrees with it
    assert sorted(p.name for p in home.rglob("*")) == before  # nothing written into the home


def test_the_fallback_is_used_where_wandb_has_no_resolution_of_its_own(home, monkeypatch):
    import wandb.sdk.lib

    monkeypatch.setitem(sys.modules, "wandb.sdk.lib.wbauth", None)  # import fails: an older or newer wandb
    monkeypatch.delattr(wandb.sdk.lib, "wbauth", raising=False)  # wandb before 0.31 has none
    assert wandb_check.wandb_credentials() is None
    netrc_entry(home, "api.wandb.ai")
    assert wandb_check.wandb_credentials() == "netrc entry for api.wandb.ai"


def logger(**values):
    return OmegaConf.create({"wandb": True, "mode": "online", "project": "quest", "entity": None, **values})


def test_an_online_run_without_credentials_is_refused_with_what_to_do(home):
    with pytest.raises(ConfigError, match="wandb login.*WANDB_API_KEY.*WANDB_MODE=offline or logger.mode=offline"):
        wandb_check.check_wandb_credentials(logger())
    for other in (logger(mode="offline"), logger(mode="disabled"), logger(wandb=False)):  # no credentials needed
        wandb_check.check_wandb_credentials(other)


def test_a_key_wandb_would_refuse_for_its_form_is_refused_up_front(home, monkeypatch):
    pytest.importorskip("wandb.sdk.lib.wbauth", reason="wandb before 0.31 has no resolution of its own to ask: quest's "
                        "fallback finds where the credentials are, not whether their form is right")
    monkeypatch.setenv("WANDB_API_KEY", "too-short")
    with pytest.raises(ConfigError, match="AuthenticationError.*wandb login"):
        wandb_check.check_wandb_credentials(logger())


@pytest.mark.parametrize("values, env_mode, problem", [
    ({}, None, None),
    ({"mode": "ofline"}, None, "logger.mode must be one of online, offline, disabled, got 'ofline'"),
    ({"mode": "ofline"}, "ofline", "comes from the environment variable WANDB_MODE"),
    ({"mode": "offline"}, "dryrunn", "WANDB_MODE (environment variable, read by wandb itself)"),
    ({"mode": "offline"}, "dryrun", None),  # wandb's own name for offline: wandb reads it, logger.mode decides
    ({"project": "a:b"}, None, "logger.project must be a wandb project name"),
    ({"project": "p" * 129}, None, "logger.project"),
    ({"entity": "team/x"}, None, "logger.entity"),
    ({"entity": "my-team"}, None, None),
    ({"wandb": False, "project": "a:b"}, "dryrunn", None),  # wandb off: its values are not used
])
def test_the_wandb_values(values, env_mode, problem, monkeypatch):
    if env_mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env_mode)
    checks = Checks(OmegaConf.create({"logger": dict(logger(mode="offline"), **values)}))
    wandb_check.check_logger_values(checks)
    if problem is None:
        assert checks.problems == []
    else:
        assert len(checks.problems) == 1 and problem in checks.problems[0], checks.problems


def failing_init(monkeypatch) -> list:
    """wandb.init as it fails when its server cannot be reached: its folder made under ``dir``, then CommError."""
    import wandb
    from wandb.errors import CommError

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        (Path(kwargs["dir"]) / "wandb" / "run-20260101_000000-abc" / "logs").mkdir(parents=True)
        raise CommError("Timed out while retrying: connection refused")

    monkeypatch.setattr(wandb, "init", init)
    return calls


def test_an_overwrite_archives_first_and_a_failed_wandb_start_says_where(tmp_path, monkeypatch):
    """trainer.overwrite=true moves the earlier run's files (its wandb/ too) to .replaced/ before wandb.init, which
    must not write into the folder being moved: a failure there leaves the earlier run archived, and says so."""
    from quest.run.outputs import WandbStartError
    from quest.train import fit

    from ..helpers import FAST, compose_cfg

    fit(compose_cfg(*FAST, "trainer.max_steps=1"), tmp_path)
    calls = failing_init(monkeypatch)
    with pytest.raises(WandbStartError, match=r"the earlier run was moved to .*\.replaced/: rerun"):
        fit(compose_cfg(*FAST, "trainer.max_steps=1", "trainer.resume=never", "trainer.overwrite=true",
                        "logger=wandb"), tmp_path)
    assert len(calls) == 1 and not (tmp_path / "wandb").exists()
    archived = list((tmp_path / ".replaced").glob("*/checkpoints/last.pt"))
    assert len(archived) == 1


def test_eval_results_stay_when_its_wandb_run_does_not_start(tmp_path, monkeypatch):
    from quest.evaluation.report import log_wandb
    from quest.run.outputs import WandbStartError

    calls = failing_init(monkeypatch)
    report = {"suite": "s", "target": {"attention": "quest"}, "settings": {}, "results": {}}
    (tmp_path / "eval_results.json").write_text("{}\n")
    with pytest.raises(WandbStartError, match=r"results are complete in .*eval\.overwrite=true"):
        log_wandb(logger(mode="offline", group=None, name=None, tags=[]), report, tmp_path, None)
    assert len(calls) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["eval_results.json"]
