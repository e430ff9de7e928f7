"""``fusion keys PLAN``: CURVE key pairs for a run, one per CompNode and one for the coordinator.

Writes ``PLAN/public_keys.json`` (every process's public key; travels with
the plan to every host) and one secret key file per process into ``--out``
(default ``keys/``): ``coordinator.secret``, ``part0.secret``, ... each
readable by its owner only (0600). Copy each secret file to the host that
runs that process only; ``fusion executor ... --key keys/part0.secret`` and
``fusion coordinator ... --key keys/coordinator.secret`` then authenticate
and encrypt every link (:mod:`fusion.executors.runtime.keys`).

Also home of :func:`security_from_args`, the rule shared by ``executor`` and
``coordinator``: ``--key`` runs CURVE; ``--insecure`` runs plain TCP with a
warning; neither is refused (one line, exit status 2, saying how to make
keys), on loopback too: a process is secure by default.
"""
from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusion.options.commands import Keys
    from fusion.options.launch import Security

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"


def security_from_args(args: "Security", plan_dir: str | Path, names: list[str], me: str, listen: str):
    """The :class:`~fusion.executors.runtime.keys.Security` for this process, or None (plain TCP).

    Raises FusionError (exit 2) when keys are needed and missing, or a key file is bad or not private.
    """
    from fusion.executors.runtime.keys import PUBLIC_KEYS_FILE, security_for
    from fusion.ir.errors import FusionError

    plan_dir = Path(plan_dir).parent if Path(plan_dir).name == "plan.json" else Path(plan_dir)
    public = Path(args.public_keys) if args.public_keys else plan_dir / PUBLIC_KEYS_FILE
    if args.insecure:
        if args.key:
            raise FusionError("--key runs CURVE and --insecure turns it off: give one of them")
        return None  # the process warns once it listens (insecure_warning)
    if args.key:
        return security_for(args.key, public, names, me)
    if public.exists():
        raise FusionError(f"{public} lists the run's CURVE keys: pass --key FILE (this process's secret key from "
                          f"`fusion keys`), or --insecure")
    # secure by default (issue 28): without keys a process refuses to start, on loopback too (any local process could
    # otherwise send it messages, a forged abort included); --insecure is the explicit way to run plain TCP
    raise FusionError(f"listening on {listen} without CURVE keys: make them with `fusion keys {plan_dir}` and pass "
                      f"--key FILE (this process's secret key), or pass --insecure (no authentication, loopback "
                      f"experiments only)")


def bind_address(plan_address: str) -> str:
    """Where to listen for a plan address ``tcp://host:port``: that host's address only, never every interface.

    A host name is resolved to its address (ZeroMQ binds interfaces and addresses, not names); loopback
    names become ``127.0.0.1``. ``--bind tcp://*:PORT`` listens everywhere when that is wanted (NAT).
    """
    from fusion.ir.errors import FusionError

    proto, _, rest = plan_address.partition("://")
    host, _, port = rest.rpartition(":")
    if proto != "tcp":
        return plan_address
    host = host.strip("[]")
    if host in ("localhost", "") or host.startswith("127."):
        return f"tcp://127.0.0.1:{port}"
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
    except OSError:
        pass
    try:
        return f"tcp://{socket.gethostbyname(host)}:{port}"
    except OSError as e:
        raise FusionError(f"cannot resolve {host!r} of the plan's address {plan_address} ({e}); pass --bind") from None


def run(args: "Keys") -> int:
    """``fusion keys`` with its options (:class:`fusion.options.commands.Keys`)."""
    from fusion.executors.runtime.keys import PUBLIC_KEYS_FILE, generate, write_public, write_secret
    from fusion.ir.errors import FusionError
    from fusion.plan import load_plan

    plan = load_plan(args.plan)
    plan_dir = Path(args.plan)
    plan_dir = plan_dir.parent if plan_dir.name == "plan.json" else plan_dir
    names = [COORDINATOR, *plan.parts] + (["relay"] if args.relay else [])
    out = Path(args.out)
    targets = [out / f"{n}.secret" for n in names]
    existing = [str(t) for t in targets if t.exists()] + ([str(plan_dir / PUBLIC_KEYS_FILE)]
                                                         if (plan_dir / PUBLIC_KEYS_FILE).exists() else [])
    if existing and not args.force:
        raise FusionError(f"keys exist already ({', '.join(existing[:3])}{', ...' if len(existing) > 3 else ''}); "
                          "pass --force to replace them")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    pairs = {n: generate(n) for n in names}
    for n, t in zip(names, targets):
        write_secret(pairs[n], t)
    write_public({n: p.public for n, p in pairs.items()}, plan_dir / PUBLIC_KEYS_FILE)
    print(f"{len(names)} key pairs: public keys in {plan_dir / PUBLIC_KEYS_FILE}, secret keys "
          f"{', '.join(str(t) for t in targets[:3])}{', ...' if len(targets) > 3 else ''} (mode 0600); "
          f"copy each secret file to the host that runs it, and nowhere else", file=sys.stderr)
    return 0
