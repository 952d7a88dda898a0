"""A loopback proxy in a process of its own that delays the first byte of every response.

``python -m benchmarks._delay_proxy UPSTREAM SECONDS`` starts ``tests.faultproxy.FaultProxy``
in front of ``UPSTREAM`` (``http://127.0.0.1:PORT``) with every request held ``SECONDS`` before
it is forwarded (so each response's first byte comes that much later, as from a distant store),
prints ``PORT <port>`` and serves until its standard input closes. In its own process, the
proxy's Python hop does not take the loader's CPU (it still shares the machine's cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from tests.faultproxy import FaultProxy, Faults


def main() -> int:
    upstream, delay = sys.argv[1], float(sys.argv[2])
    with FaultProxy(upstream) as proxy:
        proxy.set_faults(Faults(delay=delay))
        print(f"PORT {proxy.port}", flush=True)
        sys.stdin.read()  # until the parent closes the pipe (or dies)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
