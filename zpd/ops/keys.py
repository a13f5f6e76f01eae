"""`zpd keys`: make a cluster's CURVE key directory, or add a user's key to it
(layout and rights: zpd.wire.security)."""
from __future__ import annotations

import argparse
from pathlib import Path

from zpd.wire.router_proof import write_router_secret
from zpd.wire.security import RIGHTS, SecurityError, add_authorized, create_keys, write_key_pair


def add_keys_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register `zpd keys` on the top-level subparsers."""
    p = sub.add_parser(
        "keys", parents=[common], help="generate CURVE keys for a cluster",
        description="Create DIR with the cluster's CURVE keys (server, cluster, admin and client "
                    "pairs, and authorized/ public keys by rights). Copy DIR to every node and "
                    "pass --curve-keys DIR to every zpd process. With --add NAME, create one more "
                    "pair NAME.key/NAME.key_secret in DIR and authorise it with --rights.")
    p.add_argument("dir", help="key directory")
    p.add_argument("--add", default=None, metavar="NAME", help="add a key pair NAME to DIR")
    p.add_argument("--router-secret", action="store_true",
                   help="instead, write DIR/router.secret (0600): the secret a cluster without "
                        "CURVE keys hands every router and worker (--router-secret-file), so "
                        "they know the cluster's routers (`zpd launch` makes its own)")
    p.add_argument("--rights", default="client", choices=RIGHTS,
                   help="rights of the added key: client (requests), admin (also admin "
                        "commands), cluster (everything); default client")
    p.set_defaults(func=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if getattr(args, "router_secret", False):      # (callers that build args by hand)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = write_router_secret(root / "router.secret")
        print(f"created {path}; give every router and worker --router-secret-file {path}")
        return 0
    if args.add is None:
        made = create_keys(root)
        print(f"created {len(made)} CURVE key pairs in {root}: {', '.join(p.stem for p in made)}; "
              f"keep the *.key_secret files private")
        return 0
    if not (root / "server.key").exists():
        raise SecurityError(f"{root} holds no cluster keys; run `zpd keys {root}` first")
    if not args.add or Path(args.add).name != args.add or args.add.startswith("."):
        raise SecurityError(f"--add takes a plain name for the key files, not {args.add!r}")
    if (root / f"{args.add}.key").exists() or args.add in ("server", "authorized"):
        raise SecurityError(f"{root}/{args.add}.key exists already; pick another name")
    public, secret = write_key_pair(root, args.add)
    add_authorized(root, public, args.rights)
    print(f"created {secret} ({args.rights} rights); give its owner {root}/server.key and that "
          f"file renamed to client.key_secret (admin.key_secret for admin rights)")
    return 0
