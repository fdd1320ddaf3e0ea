"""upipe vs the real peers (DeepSpeed-Ulysses, yunchang, torch context_parallel), one run.

A thin entry point to `upipe bench` (the measurement lives in `upipe.bench`, which uses
only upipe's public API); the same options:

    python benchmarks/bench_peers.py                                   # 4 CPU ranks
    python benchmarks/bench_peers.py --seq-lens 4096 8192 16384 \\
        --json docs/benchmarks.json --plot docs/benchmarks.png          # docs/benchmarks.md
    torchrun --nproc-per-node 8 benchmarks/bench_peers.py --device cuda

The peers come from the optional extra: pip install -e '.[bench]'.
"""

import sys

from upipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
