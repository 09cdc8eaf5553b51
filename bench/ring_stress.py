"""Ring-buffer stress and hand-off latency between processes: ``vla-runtime bench-ipc`` as a script.

    python bench/ring_stress.py --out out/ipc.json                 # 100k hand-offs, pi05-small prefix slot
    python bench/ring_stress.py --handoffs 20000 --latency-handoffs 1000

Exit status 1 if any torn read was accepted. See ``vla_runtime/ipc/bench.py`` for the phases.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vla_runtime.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench-ipc", *sys.argv[1:]]))
