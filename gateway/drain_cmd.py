"""``kvgate drain NODE``: drain one node through a running kvgate's admin API (``gateway.drain``).

Made for a pod's ``preStop`` hook: it returns by ``--deadline`` plus a few seconds whatever
happens (the admin API stops at the deadline, and this client gives up shortly after), prints
the drain's report as JSON, and exits 0 when the drain completed, 3 when the deadline came first
(the node takes no new requests either way), 1 when the drain could not run at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_DEADLINE_S = 30.0  # gateway.drain's default (not imported: this client starts in a preStop hook, fast)
CLIENT_GRACE_S = 5.0


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("node", help="node_id as registered in the directory")
    p.add_argument("--admin-url", default=os.environ.get("KVGATE_ADMIN_URL", "http://127.0.0.1:9000"),
                   help="kvgate's admin API (default: $KVGATE_ADMIN_URL or http://127.0.0.1:9000)")
    p.add_argument("--token-file", default=os.environ.get("KVGATE_ADMIN_TOKEN_FILE"),
                   help="file holding the admin token (default: $KVGATE_ADMIN_TOKEN_FILE; or set $KVGATE_ADMIN_TOKEN)")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S, help="seconds the drain may take")
    p.add_argument("--undo", action="store_true", help="take the node back instead (it gets new requests again)")


def _token(args: argparse.Namespace) -> str:
    if args.token_file:
        with open(args.token_file) as f:
            return f.read().strip()
    return os.environ.get("KVGATE_ADMIN_TOKEN", "").strip()


def run(args: argparse.Namespace) -> int:
    try:
        token = _token(args)
    except OSError as e:
        print(f"kvgate drain: cannot read the token file: {e}", file=sys.stderr)
        return 1
    if not token:
        print("kvgate drain: no admin token (--token-file, $KVGATE_ADMIN_TOKEN_FILE or $KVGATE_ADMIN_TOKEN)", file=sys.stderr)
        return 1
    if not args.deadline > 0:
        print(f"kvgate drain: --deadline must be > 0, got {args.deadline}", file=sys.stderr)
        return 1
    node = urllib.parse.quote(args.node, safe="")
    query = "" if args.undo else "?" + urllib.parse.urlencode({"deadline_s": args.deadline})
    req = urllib.request.Request(
        f"{args.admin_url.rstrip('/')}/admin/drain/{node}{query}", method="DELETE" if args.undo else "POST",
        headers={"Authorization": f"Bearer {token}"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=args.deadline + CLIENT_GRACE_S) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        print(f"kvgate drain: cannot reach the admin API at {args.admin_url}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 1
    try:
        doc = json.loads(body)
    except ValueError:
        doc = {"error": body.decode(errors="replace")[:200]}
    if status >= 400:
        print(f"kvgate drain: {args.node}: HTTP {status}: {doc.get('error', doc)}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2))
    return 0 if status == 200 else 3
