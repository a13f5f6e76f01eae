"""`zpd admin`: send one admin command to a router (which fans it out to every
worker) or straight to one worker, print one JSON object, and exit 0 only when
every worker carried it out.

Exit codes: 0 all ok; 1 the command failed on at least one worker (see the
per-worker results); 2 bad usage; 3 no answer within --timeout (endpoint down
or unreachable).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import orjson

from zpd.ops.options import ROUTER_ENDPOINT
from zpd.wire.admin import (AbortAll, AbortRequest, AdminCommand, CancelWeightUpdate, Continue, FlushCache, Pause, ReleaseMemory, ResumeMemory, Status, UpdateWeights, UpdateWeightVersion)
from zpd.wire.admin_fields import MEMORY_TAGS, BadArgs, PauseMode

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_ANSWER = 0, 1, 2, 3

# CLI subcommand -> (help, the command's record from the parsed flags)
COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], AdminCommand]]] = {
    "pause": ("stop scheduling: --mode abort (end in-flight requests with 499), in_place "
              "(keep their KV) or retract (free their KV, keep the requests)",
              lambda a: Pause(a.mode)),
    "continue": ("resume after pause (retracted requests are recomputed)", lambda a: Continue()),
    "update-weights": ("load new weights from a checkpoint directory (on every worker's host) "
                       "while paused or idle; without --version the version stays as it is",
                       lambda a: UpdateWeights(a.path, a.version or None)),
    "update-weight-version": ("set the weight version the next tokens report (the weights "
                              "stay as they are)", lambda a: UpdateWeightVersion(a.version)),
    "status": ("queues, KV pages, peers, weight version and pause mode per worker",
               lambda a: Status()),
    "abort": ("end request RID with 499", lambda a: AbortRequest(a.rid)),
    "abort-all": ("end every request queued or in flight at the router with 499 (a router "
                  "only)", lambda a: AbortAll()),
    "release-memory": ("free the memory of the KV pool and/or the weights (--tags; default "
                       "all) while paused or idle", lambda a: ReleaseMemory(a.tags)),
    "resume-memory": ("allocate the KV pool again and/or restore the weights (--tags; "
                      "default all)", lambda a: ResumeMemory(a.tags)),
    "flush-cache": ("drop cached KV not held by a request", lambda a: FlushCache()),
    "cancel-weight-update": ("end a trainer's weight push or init_weights_update_group under "
                             "way: every worker keeps its old weights and leaves the trainer's "
                             "group", lambda a: CancelWeightUpdate()),
}


def add_admin_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register `zpd admin` and its commands on the top-level subparsers."""
    p = sub.add_parser(
        "admin", parents=[common], help="send an admin command to a router or a worker",
        description="Send one admin command and print one JSON object: through a router, "
                    '{"ok", "command", "workers": [one result per worker], ...}; to a worker, '
                    "that worker's result. Exit 0 when every worker succeeded, 1 when any "
                    "failed, 3 when no answer came within --timeout.")
    p.add_argument("--endpoint", default=ROUTER_ENDPOINT,
                   help=f"router or worker endpoint H:P (default {ROUTER_ENDPOINT})")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for every answer (default 10)")
    p.add_argument("--curve-keys", default=None,
                   help="CURVE key directory (see `zpd keys`); connects with its admin key")
    cmds = p.add_subparsers(dest="admin_command", required=True, metavar="ADMIN_COMMAND")
    for name, (text, _) in COMMANDS.items():
        c = cmds.add_parser(name, help=text, description=text)
        if name == "pause":
            c.add_argument("--mode", required=True, choices=[m.value for m in PauseMode])
        elif name == "update-weights":
            c.add_argument("--path", required=True, help="checkpoint directory on the workers' hosts")
            c.add_argument("--version", default=None, help="weight version string to report "
                                                           "(default: keep the current one)")
        elif name == "update-weight-version":
            c.add_argument("--version", required=True, help="weight version string to report")
        elif name in ("release-memory", "resume-memory"):
            c.add_argument("--tags", nargs="+", choices=MEMORY_TAGS,
                           default=None, help="what to release or resume (default: all)")
        elif name == "abort":
            c.add_argument("rid", help="request id")
    p.set_defaults(func=run_admin)


def run_admin(args: argparse.Namespace) -> int:
    from zpd.client import Client
    from zpd.wire.security import client_curve

    _, build = COMMANDS[args.admin_command]
    if args.timeout <= 0:
        print("zpd admin: error: --timeout must be positive", file=sys.stderr)
        return EXIT_USAGE
    try:
        cmd = build(args)
    except BadArgs as e:
        print(f"zpd admin: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    wire = cmd.COMMAND
    curve = client_curve(args.curve_keys, "admin") if args.curve_keys else None
    try:
        with Client(args.endpoint, timeout=args.timeout, curve=curve) as client:
            reply = client.admin(wire, timeout=args.timeout, **cmd.args())
    except TimeoutError as e:
        print(f"zpd admin: error: {args.endpoint} did not answer {wire!r} within "
              f"{args.timeout:g} s (is the router or worker running, and the address right?): {e}",
              file=sys.stderr)
        _print({"ok": False, "endpoint": args.endpoint, "command": wire, "status": 504,
                "error": f"no answer within {args.timeout:g} s"})
        return EXIT_NO_ANSWER
    ok = all_ok(reply)
    reply["ok"] = ok
    _print(reply)
    if not ok:
        for failure in failures(reply):
            print(f"zpd admin: {wire} failed on {failure.get('role', '?')} "
                  f"{failure.get('endpoint', args.endpoint)}: {failure.get('status', '')} "
                  f"{failure.get('error', '')}".rstrip(), file=sys.stderr)
    return EXIT_OK if ok else EXIT_FAILED


def all_ok(reply: dict) -> bool:
    """True only if the reply and every per-worker result in it say ok."""
    return bool(reply.get("ok")) and all(w.get("ok") for w in reply.get("workers", []))


def failures(reply: dict) -> list[dict]:
    """The failed per-worker results, or the reply itself when it came from one worker."""
    bad = [w for w in reply.get("workers", []) if not w.get("ok")]
    return bad or ([] if reply.get("ok") else [reply])


def _print(obj: dict) -> None:
    sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    sys.stdout.flush()
