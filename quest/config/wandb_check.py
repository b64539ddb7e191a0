"""logger=wandb's checks, made with the config's before a command moves, archives or writes anything: the wandb
values (logger.mode, and WANDB_MODE that gives logger=wandb its mode; logger.project, logger.entity), and, for an
online run, that wandb has credentials. Without them ``wandb.init`` would fail (or, at a terminal, prompt) only once
the run directory had been written to. Nothing here connects to the network, prompts, or writes a file: whether the
key is accepted by the server is left to ``wandb.init``, which cannot be asked without starting a run (and writing its
folder), so a training run starts it as its first change once the checks have passed (quest.train.lifecycle).

Where wandb finds credentials (wandb 0.31, ``wandb.sdk.lib.wbauth``; what ``wandb.init`` calls before it prompts):
the environment (WANDB_API_KEY, or WANDB_IDENTITY_TOKEN_FILE for federated identity), then the netrc file (NETRC, else
``~/.netrc``) entry of the W&B server (WANDB_BASE_URL, the settings file's ``base_url``, else wandb's default), then
the ``api_key`` of wandb's settings file (WANDB_CONFIG_DIR/settings, else ``~/.config/wandb/settings``). wandb has no
public function that answers this without side effects (``wandb.login(prompt=False)`` asks the server for the user
name when a key is found; ``wandb.api.api_key`` is deprecated), so the check calls wandb's own resolution where the
installed wandb has it, and otherwise reads the environment and the netrc entry itself (:func:`_read_credentials`).
"""
from __future__ import annotations

import netrc
import os
from typing import Any
from urllib.parse import urlsplit

from quest.config.checks import Checks, ConfigError

__all__ = ["MODES", "check_logger_values", "check_wandb_credentials", "wandb_credentials"]

#: logger.mode: wandb.init's modes that quest runs with
MODES = ("online", "offline", "disabled")
#: the modes wandb itself accepts in WANDB_MODE (wandb.Settings.mode); any other stops wandb.init whatever the mode
#: passed to it
WANDB_MODES = (*MODES, "dryrun", "run", "shared")
#: characters wandb refuses in a project name (wandb.Settings.validate_project), and its longest name
PROJECT_CHARS = "/\\#?%:"
PROJECT_MAX = 128
#: the W&B server wandb 0.31 logs in to unless WANDB_BASE_URL or its settings file names another (the fallback's)
DEFAULT_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")

HOW_TO_LOG_IN = ("run `wandb login`, or set WANDB_API_KEY; or log offline: WANDB_MODE=offline or logger.mode=offline "
                 "(`wandb sync <run>/wandb` uploads an offline run later)")


def check_logger_values(c: Checks) -> None:
    """The logger config's wandb values, into ``c``: logger.mode (naming WANDB_MODE when the value came from it),
    logger.project and logger.entity (wandb's own limits), and WANDB_MODE itself with logger=wandb (wandb reads it
    however the mode is passed)."""
    mode, env_mode = c.value("logger.mode"), os.environ.get("WANDB_MODE")
    if mode not in MODES:
        origin = (" (its value comes from the environment variable WANDB_MODE, which logger=wandb reads: set "
                  "WANDB_MODE=offline or online, or unset it)" if env_mode is not None and mode == env_mode else "")
        c.fail("logger.mode", f"must be one of {', '.join(MODES)}{origin}")
    if not c.value("logger.wandb"):
        return
    if env_mode is not None and env_mode not in WANDB_MODES and mode != env_mode:  # else named with logger.mode
        c.problems.append(f"  WANDB_MODE (environment variable, read by wandb itself) must be one of "
                          f"{', '.join(WANDB_MODES)} or unset, got {env_mode!r}")
    c.check("logger.project", lambda v: isinstance(v, str) and 0 < len(v) <= PROJECT_MAX
            and not set(v) & set(PROJECT_CHARS),
            f"a wandb project name: 1 to {PROJECT_MAX} characters, none of {' '.join(PROJECT_CHARS)}")
    c.check("logger.entity", lambda v: isinstance(v, str) and v.strip() == v and v != "" and "/" not in v,
            "a wandb entity (a user or team name, without '/' or surrounding spaces)", optional=True)


def check_wandb_credentials(logger: Any) -> None:
    """Raise :class:`ConfigError` when an online wandb run (logger.wandb, logger.mode=online) has no credentials, or
    credentials wandb would refuse for their form; nothing for any other logger config."""
    if not logger.get("wandb") or logger.get("mode") != "online":
        return
    try:
        source = wandb_credentials()
    except Exception as exc:  # wandb's own error about what it found (a key of the wrong form, two sources at once)
        raise ConfigError(f"logger.mode=online: wandb's credentials cannot be used ({type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}); {HOW_TO_LOG_IN}") \
            from None
    if source is None:
        raise ConfigError(f"logger.mode=online needs wandb credentials and none were found (WANDB_API_KEY, "
                          f"WANDB_IDENTITY_TOKEN_FILE, a netrc entry, wandb's settings file): {HOW_TO_LOG_IN}")


def wandb_credentials() -> str | None:
    """Where an online ``wandb.init`` would take its credentials from (a non-empty description), or None when it
    would prompt for them; raises wandb's error for credentials of a wrong form. Reads, never prompts, writes or
    connects."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings  # env and settings files; starts no service
        auth = wbauth.authenticate_session(host=settings.base_url, source="quest", prompt=False,
                                           update_session=False)
    except (ImportError, AttributeError, TypeError):  # a wandb without this resolution: read what it reads
        return _read_credentials()
    return None if auth is None else f"{type(auth).__name__} for {auth.host}"


def _read_credentials() -> str | None:
    """The fallback: WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or the netrc entry (Python's netrc module: NETRC,
    else ~/.netrc) of WANDB_BASE_URL's host or, without it, of wandb's default hosts."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(name):
            return name
    base = os.environ.get("WANDB_BASE_URL")
    hosts = [urlsplit(base).netloc] if base else list(DEFAULT_HOSTS)
    try:
        entries = netrc.netrc(os.environ.get("NETRC") or None)
    except (OSError, netrc.NetrcParseError):  # no netrc file (or one netrc cannot read: wandb ignores it too)
        return None
    for host in hosts:
        found = entries.authenticators(host)
        if found is not None and found[2]:
            return f"netrc entry for {host}"
    return None
