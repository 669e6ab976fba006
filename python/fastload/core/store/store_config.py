"""How a load reaches object storage: the caller's ``storage_options``, and the AWS profile files.

Credentials and endpoints come from the standard places, in this order of precedence (the first
that gives a value wins):

1. ``storage_options=`` of the call: ``object_store``'s configuration keys (``aws_endpoint``,
   ``aws_region``, ``aws_access_key_id``, ``google_service_account``,
   ``azure_storage_account_name`` ...; the client's ``timeout``, ``connect_timeout``,
   ``read_timeout`` ...) and fastload's retry policy (``max_retries``, ``retry_timeout``,
   ``retry_init_backoff``, ``retry_max_backoff``, ``retry_backoff_base``);
2. the environment: ``AWS_*`` (``AWS_ENDPOINT_URL`` for S3-compatible stores, ``AWS_REGION``,
   ``AWS_ACCESS_KEY_ID`` ...), ``GOOGLE_*`` (``GOOGLE_APPLICATION_CREDENTIALS`` ...),
   ``AZURE_*`` (``AZURE_STORAGE_ACCOUNT_NAME`` ...), read by the Rust core;
3. for S3, the AWS shared files: ``~/.aws/credentials`` and ``~/.aws/config`` (or
   ``AWS_SHARED_CREDENTIALS_FILE`` / ``AWS_CONFIG_FILE``), profile ``AWS_PROFILE`` (else
   ``default``): keys, session token, ``region``, ``endpoint_url``; credentials are taken from
   the files only when neither 1. nor 2. gives any (a key from one place and a secret from
   another would be another identity);
4. what the store's client finds itself: instance and container credentials (EC2/ECS
   metadata, web identity tokens, GCP metadata, Azure managed identity).

Values are credentials: nothing here prints, logs or puts them in a message; an error about an
option names its key only.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from pathlib import Path

from fastload.core.basics.errors import RequestError

#: the AWS files' credential keys (taken together, or not at all)
_CREDENTIALS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
#: ``storage_options`` keys that name credentials, in any of object_store's spellings
_CREDENTIAL_OPTIONS = {
    "aws_access_key_id",
    "access_key_id",
    "aws_secret_access_key",
    "secret_access_key",
    "aws_session_token",
    "aws_token",
    "session_token",
    "token",
}


def check_storage_options(options: object, where: str) -> dict[str, str] | None:
    """``options`` (``None`` or a mapping of str keys to str, int, float or bool values) as
    strings, as the store's client takes them; ``TypeError`` naming the key otherwise (never the
    value: it may be a secret)."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise TypeError(
            f"{where}: storage_options must be a dict of option name to value, got "
            f"{type(options).__name__}"
        )
    out: dict[str, str] = {}
    for key, value in options.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{where}: storage_options keys must be non-empty str, got {key!r}")
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            out[key] = str(value)
        else:
            raise TypeError(
                f"{where}: storage_options[{key!r}] must be a str, int, float or bool, got "
                f"{type(value).__name__}"
            )
    return out


def _read_ini(path: Path) -> configparser.RawConfigParser | None:
    """The INI file at ``path`` (``None`` if there is none); a malformed one is a
    ``RequestError`` naming the file and its line numbers, never its text."""
    if not path.is_file():
        return None
    parser = configparser.RawConfigParser(interpolation=None)
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f)
    except configparser.ParsingError as e:
        lines = ", ".join(str(n) for n, _ in e.errors)
        raise RequestError(f"{path}: not a valid AWS configuration file (lines {lines})") from None
    except (configparser.Error, UnicodeDecodeError, OSError) as e:
        raise RequestError(
            f"{path}: cannot read this AWS configuration file ({type(e).__name__})"
        ) from None
    return parser


def _section(parser: configparser.RawConfigParser | None, *names: str) -> dict[str, str]:
    if parser is None:
        return {}
    for name in names:
        if parser.has_section(name):
            return {k.lower(): v.strip() for k, v in parser.items(name)}
    return {}


def aws_profile_defaults(options: Mapping[str, str] | None = None) -> dict[str, str]:
    """The AWS shared files' values for the active profile, as object_store's keys
    (``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``, ``aws_region``,
    ``aws_endpoint``): the lowest precedence (the core uses them where the environment and the
    options are silent). Credentials are left out when the environment or ``options`` give any.
    """
    home = Path.home()
    env = os.environ
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    credentials = _read_ini(
        Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials")
    )
    config = _read_ini(Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config"))
    # ~/.aws/config names profiles "profile NAME", except the default one
    conf = _section(config, f"profile {profile}", profile)
    creds = _section(credentials, profile)
    out: dict[str, str] = {}
    given = {k.lower() for k in options or {}}
    if not env.get("AWS_ACCESS_KEY_ID") and not given & _CREDENTIAL_OPTIONS:
        source = creds if creds.get("aws_access_key_id") else conf
        out.update({k: source[k] for k in _CREDENTIALS if source.get(k)})
    if conf.get("region"):
        out["aws_region"] = conf["region"]
    if conf.get("endpoint_url"):
        out["aws_endpoint"] = conf["endpoint_url"]
    return out


__all__ = ["aws_profile_defaults", "check_storage_options"]
